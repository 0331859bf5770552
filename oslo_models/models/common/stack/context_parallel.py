"""What a model's forward does differently under context parallelism (``ParallelConfig.context_parallel_size``).

Each rank holds its chunk(s) of every sequence (``data/collators/context_parallel.py`` cuts them). Three things
change in a forward, all of them here so the families call the same code:

- the attention mask: a ``ContextParallelMask`` (global token positions, gathered padding) in place of the
  ``[b, 1, s, s]`` mask, which routes every attention layer to the context-parallel core; an ALiBi family (Bloom,
  Falcon with ``alibi``) says its slopes through ``context_parallel_alibi()`` and the mask carries the bias;
- default ``position_ids``: the *global* positions of this rank's tokens (learned position embeddings, rotary);
- the loss: targets are pre-shifted (``shift_labels``) for causal LMs, since a chunk cannot see the next chunk's
  first token, and the mean runs over the labelled tokens of the whole sequence (``context_parallel/loss.py``);
- a rotary whose frequencies depend on the longest position of the forward (``transformers``' ``dynamic`` and
  ``longrope`` types: Phi-3's short/long factors) is told the whole sequence's (``rotary_embeddings``);
- the classification heads: the last non-padding token's logits come from the cp rank holding it
  (``last_token_logits``), a span head's start/end logits are gathered to the whole sequence
  (``gather_over_context``), a token classifier's loss is a mean over the whole sequence (``token_loss``).

Gradient convention (as ``context_parallel/loss.py``): every cp rank's backward is ``cp`` times its share, which the
gradient mean over dp x cp turns into the whole sequence's gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ....parallel_layers.context_parallel import (
    build_context_parallel_mask,
    context_num_items,
    merge_sequence,
    split_sequence,
    sum_over_context,
    token_index,
    with_alibi,
)
from ..rules.capabilities import capabilities_of


def context_parallel_inputs(model, inputs_embeds: torch.Tensor, attention_mask, position_ids, past_key_values=None,
                            *, causal: bool, default_positions: bool = True):
    """``(mask, position_ids)``: ``(None, position_ids)`` at cp=1; else the ``ContextParallelMask`` of this
    forward (one all-gather over cp) and ``position_ids`` (given, or this rank's global positions ``[1, s_local]``
    when ``default_positions``; otherwise a missing ``position_ids`` is a ``ValueError``). A model with a
    ``context_parallel_alibi(device)`` method returning ``(slopes [n/tp], divisor)`` (or ``None``) gets the mask
    with that ALiBi bias (``parallel_layers/context_parallel/mask.with_alibi``: key positions from what the mask
    gathered, no further collective)."""
    context = model.parallel_context
    if context.cp_size == 1:
        return None, position_ids
    if past_key_values is not None and past_key_values.get_seq_length() > 0:
        raise NotImplementedError("a key/value cache (generation) under context parallelism is not implemented")
    if position_ids is None and not default_positions:
        raise ValueError(f"{type(model).__name__} derives position ids from the whole sequence: under context "
                         "parallelism pass position_ids computed on the full sequence (split like input_ids)")
    # packed documents in position_ids (with or without a padding mask, as the layouts without cp find them), not
    # while decoding from a cache
    packed = position_ids if causal and past_key_values is None else None
    mask = build_context_parallel_mask(context, attention_mask, inputs_embeds, causal=causal, position_ids=packed)
    alibi = getattr(model, "context_parallel_alibi", None)
    slopes = alibi(inputs_embeds.device) if alibi is not None else None
    if slopes is not None:  # (this tp rank's head slopes [n/tp], divisor)
        mask = with_alibi(mask, *slopes, batch=inputs_embeds.shape[0])
    if position_ids is None:
        position_ids = mask.token_index[context.cp_rank][None]
    return mask, position_ids


def rotary_embeddings(model, rotary, shape_like: torch.Tensor, position_ids: torch.Tensor):
    """``rotary(shape_like, position_ids)``: ``(cos, sin)`` ``[b, s, d]`` (or a dict of them, one pair per attention
    type, from a rotary with a rope type per type). ``transformers``' ``dynamic`` and ``longrope`` rotaries pick their
    frequencies from ``max(position_ids) + 1`` of the forward; under context parallelism this rank holds a chunk
    only, so the whole sequence's largest position (one all-reduce of a scalar, max over cp) joins its positions as
    one extra column, whose ``cos``/``sin`` are dropped. Other rope types and cp=1: the plain call."""
    rope_type = getattr(rotary, "rope_type", None)
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    length_dependent = any(isinstance(kind, str) and ("dynamic" in kind or kind == "longrope") for kind in kinds)
    context = model.parallel_context
    if context.cp_size == 1 or not length_dependent:
        return rotary(shape_like, position_ids)
    top = position_ids.max().reshape(1, 1).clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=context.cp_group)
    out = rotary(shape_like, torch.cat([position_ids, top.expand(position_ids.shape[0], 1)], dim=1))
    if isinstance(out, dict):
        return {kind: (cos[:, :-1], sin[:, :-1]) for kind, (cos, sin) in out.items()}
    cos, sin = out
    return cos[:, :-1], sin[:, :-1]


def context_parallel_loss_items(model, labels, num_items_in_batch, *, shift_labels=None, causal: bool):
    """At cp=1 ``num_items_in_batch`` unchanged; else the labelled-token count of the whole sequence, to divide this
    rank's loss sum by. A causal LM needs ``shift_labels`` (``ValueError`` otherwise)."""
    context = model.parallel_context
    if context.cp_size == 1:
        return num_items_in_batch
    if causal and shift_labels is None:
        raise ValueError("under context parallelism a causal LM needs shift_labels (the targets shifted on the full "
                         "sequence before it was split; ContextParallelSplitter(shift_labels=True) makes them): a "
                         "rank's chunk cannot see the next chunk's first token")
    return context_num_items(context, shift_labels if causal else labels, num_items_in_batch)


def context_parallel_loss(model, loss):
    """The loss of the whole sequence from this rank's part (all-reduce over cp; backward ``x cp``)."""
    if loss is None or model.parallel_context.cp_size == 1:
        return loss
    return sum_over_context(loss, model.parallel_context)


class _GatherOverContext(torch.autograd.Function):
    """Forward: the whole sequence from every cp rank's chunk(s) (all-gather, then ``merge_sequence``). Backward:
    this rank's chunk(s) of the gradient, times ``cp`` (every rank computes the same loss from the gathered tensor:
    the gradient convention of the module docstring)."""

    @staticmethod
    def forward(ctx, x, context, dim):
        ctx.context, ctx.dim = context, dim
        parts = [torch.empty_like(x) for _ in range(context.cp_size)]
        dist.all_gather(parts, x.contiguous(), group=context.cp_group)
        return merge_sequence(parts, context.config.context_parallel_mode, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        context = ctx.context
        local = split_sequence(grad, context.cp_rank, context.cp_size, context.config.context_parallel_mode, ctx.dim)
        return local * context.cp_size, None, None


def gather_over_context(model, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``x`` with this rank's chunk(s) along ``dim`` -> the whole sequence (one all-gather over cp); ``x`` at
    cp=1."""
    context = model.parallel_context
    return x if context.cp_size == 1 else _GatherOverContext.apply(x, context, dim)


def last_token_logits(model, logits: torch.Tensor, input_ids, pad_token_id) -> torch.Tensor:
    """``logits [b, s_local, L]`` of this rank's chunk(s) -> ``[b, L]`` at each row's rightmost non-padding token
    of the *whole* sequence (as ``heads.last_token_logits`` at cp=1): its global position is a max over cp (one
    all-reduce of ``[b]``), the rank holding it contributes the row and the rows are summed over cp (one
    all-reduce of ``[b, L]``; backward ``x cp``)."""
    context = model.parallel_context
    batch, seq = logits.shape[:2]
    if pad_token_id is None and batch != 1:
        raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
    positions = token_index(seq, context.cp_rank, context.cp_size, context.config.context_parallel_mode,
                            device=logits.device)
    if pad_token_id is None or input_ids is None:
        last = torch.full((batch,), seq * context.cp_size - 1, dtype=torch.long, device=logits.device)
    else:  # transformers: argmax(positions * non_pad), i.e. the largest non-padding position (0 if none)
        last = (positions * (input_ids.to(logits.device) != pad_token_id)).amax(-1)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=context.cp_group)
    pick = (positions[None, :] == last[:, None]).to(logits.dtype)  # [b, s_local]: one 1 per row on one rank
    return sum_over_context((logits * pick[..., None]).sum(1), context)


def token_loss(model, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy of a token classifier's ``logits [b, s_local, L]``: the mean over the labelled tokens of the
    whole sequence, or over the summed ``num_items_in_batch`` shares (count and loss summed over cp, as the
    masked-LM loss)."""
    labels = labels.to(logits.device)
    count = context_parallel_loss_items(model, labels, num_items_in_batch, causal=False)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return context_parallel_loss(model, total / count)


def check_context_parallel(model_class, config, parallel) -> None:
    """Before any collective: ``NotImplementedError`` for a model class that does not run under context parallelism
    (its ``Capabilities.context_parallel``, ``common/rules/capabilities.py``; not ``transformers``' own
    ``_supports_context_parallel``, which is ``True`` on every model: the base models and LM heads of GPT-2, BERT and
    the stack decoders, T5's and BART's base models and conditional-generation heads, and the stack decoders'
    classification heads; heads that pool one token of an encoder do not), ``ValueError`` for heads that all-to-all
    cannot split."""
    cp = parallel.context_parallel_size
    if cp == 1:
        return
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    capabilities = capabilities_of(model_class)
    # MoE: only a family whose router loss reduces its statistics over cp (``moe_context_parallel``)
    if (experts and not capabilities.moe_context_parallel) or not capabilities.context_parallel:
        raise NotImplementedError(f"{model_class.__name__} under context_parallel_size={cp} is not implemented; "
                                  f"the base models and LM heads of GPT-2, BERT and the stack decoders are, T5's "
                                  f"and BART's base models and conditional-generation heads, and the stack "
                                  f"decoders' sequence/token classification and question answering heads")
    if parallel.context_parallel_mode in ("all_to_all", "hybrid"):
        # the heads follow the tensor-parallel split: tp blocks at 1D, the grid's q hidden blocks at 2D/2.5D/3D
        split, name = ((parallel.tensor_parallel_size, "tensor_parallel_size") if parallel.tensor_parallel_mode == "1d"
                       else (parallel.grid_shape[-1], f"the grid's q ({parallel.tensor_parallel_mode})"))
        heads = config.num_attention_heads // split
        mode = parallel.context_parallel_mode
        group, group_name = ((cp, "context_parallel_size") if mode == "all_to_all"
                             else (parallel.context_parallel_all_to_all_size, "context_parallel_all_to_all_size"))
        if heads % group:
            raise ValueError(f"context_parallel_mode={mode!r} needs the attention heads per tensor-parallel rank "
                             f"({config.num_attention_heads} / {name}={split} = {heads}) divisible by "
                             f"{group_name}={group}; use context_parallel_mode='ring'")


def causal_lm_head_outputs(model, hidden_states: torch.Tensor, labels=None, *, logits_to_keep=0,
                           gather_logits: bool = True, num_items_in_batch=None, shift_labels=None,
                           skip_logits: bool = False, logit_softcap: float | None = None):
    """``(loss, logits)`` of a causal LM's ``model.lm_head`` on the last hidden states ``[b, s(/cp), h]``:
    ``lm_head_loss_and_logits`` (fused and chunked with ``skip_logits``, then ``logits`` is ``None``) with the
    model's ``fused_ops`` switch; under context parallelism the loss is the mean over the whole sequence (token count
    and loss sum all-reduced over cp). ``logit_softcap``: Gemma 2/3's final logit soft-cap, elementwise on each
    token's logits before the loss (so it holds under tp, sp, cp and pp alike)."""
    from ..loss.lm_loss import lm_head_loss_and_logits

    # ParallelConfig.tiled_loss: the training loss chunked, no [b, s, vocab] logits (logits None)
    skip_logits = skip_logits or (labels is not None and model.training and model.parallel_context.config.tiled_loss)
    if labels is not None:
        num_items_in_batch = context_parallel_loss_items(model, labels, num_items_in_batch,
                                                         shift_labels=shift_labels, causal=True)
    loss, logits = lm_head_loss_and_logits(model.lm_head, hidden_states, labels, logits_to_keep=logits_to_keep,
                                           gather_logits=gather_logits, num_items_in_batch=num_items_in_batch,
                                           shift_labels=shift_labels, skip_logits=skip_logits,
                                           fused=model.parallel_context.config.fused_ops, logit_softcap=logit_softcap)
    return context_parallel_loss(model, loss), logits
