"""A causal LM's per-token log-probabilities of its own input, from the vocab-split logits of its head.

``model(input_ids, gather_logits=False)`` gives this rank's ``[b, s, V_padded/tp]`` logits (a native family's head;
``transformers``' own classes on the generic path give the whole vocabulary, which is then the shard); the
log-probabilities of ``input_ids[:, 1:]`` come from :func:`oslo_models.losses.token_statistics`: one all-reduce
MAX and one all-reduce SUM of ``[k, tokens]`` over the tensor-parallel group in the forward, none in the backward.
The full-vocabulary logits are never gathered.

The targets are the ids shifted left and padded with ``-100`` (not the logits cut to ``[:, :-1]``, which would copy
them), so the fields come out as ``[b, s]`` and are cut to ``[b, s - 1]``: position ``i`` scores ``input_ids[:, i +
1]``, 0 where ``completion_mask[:, i + 1]`` is 0 (the prompt, padding).

A pipelined model (``pipeline_parallel_size > 1``) is refused here: its forward is the schedule's, which returns no
logits (``PIPELINE_REFUSAL``); ``train_step`` runs the objectives as its last stage's loss (``pipelined.py``).
"""
from __future__ import annotations

import inspect

import torch

from ..losses import VocabShard, token_statistics
from ..training.zero import unwrap_model

PIPELINE_REFUSAL = (
    "A pipelined model's forward is its schedule: the logits exist only on the last stage, one microbatch at a time, "
    "and are not returned. Run DPO / GRPO / distillation on it through om.post_training.train_step (the objective "
    "becomes the last stage's loss), or score with an unpipelined copy (pipeline_parallel_size=1)")


def base_model_of(model):
    """The ``oslo_models`` / ``transformers`` model inside DDP and ``peft`` wrappers."""
    inner = unwrap_model(model)
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    return inner


def check_not_pipelined(model) -> None:
    """``NotImplementedError`` for a pipelined model (before any collective)."""
    context = getattr(base_model_of(model), "parallel_context", None)
    if context is not None and context.pp_size > 1:
        raise NotImplementedError(PIPELINE_REFUSAL)


def is_vocab_split(model) -> bool:
    """Whether ``model``'s forward takes ``gather_logits`` (a native family's causal-LM head)."""
    base = base_model_of(model)
    return hasattr(base, "parallel_context") and "gather_logits" in inspect.signature(type(base).forward).parameters


def local_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 **kwargs) -> tuple[torch.Tensor, VocabShard]:
    """``(logits [b, s, V_local], shard)``: the forward of ``model`` (any wrapper: DDP, FSDP2, ``peft``) with the
    logits left split by vocabulary; ``kwargs`` go to the forward (e.g. ``position_ids``)."""
    check_not_pipelined(model)
    kwargs = dict(kwargs, use_cache=False)
    if is_vocab_split(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, gather_logits=False, **kwargs).logits
        return logits, VocabShard.of(base_model_of(model))
    return model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits, VocabShard()


def next_token_targets(input_ids: torch.Tensor, completion_mask: torch.Tensor | None) -> torch.Tensor:
    """``[b, s]``: ``input_ids[:, i + 1]`` at ``i`` where ``completion_mask[:, i + 1]`` is set, else ``-100``; the
    last column ``-100``."""
    targets = input_ids[:, 1:]
    if completion_mask is not None:
        targets = targets.masked_fill(completion_mask[:, 1:] == 0, -100)
    return torch.nn.functional.pad(targets, (0, 1), value=-100)


def sequence_token_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                             completion_mask: torch.Tensor | None = None, *, temperature: float = 1.0,
                             outputs=("log_probs",), chunk_size: int | None = None) -> dict:
    """Per-token fields ``[b, s - 1]`` (``outputs``: any of ``losses.FIELDS``; ``log_probs`` differentiable)
    of ``model`` scoring ``input_ids [b, s]``: position ``i`` is the next token ``input_ids[:, i + 1]``, zero where
    ``completion_mask[:, i + 1] == 0`` (``None``: every token). Same on every tensor-parallel rank."""
    logits, shard = local_logits(model, input_ids, attention_mask)
    targets = next_token_targets(input_ids.to(logits.device),
                                 None if completion_mask is None else completion_mask.to(logits.device))
    fields = token_statistics(logits, targets, shard=shard, outputs=outputs, temperature=temperature,
                              chunk_size=chunk_size)
    mask = targets[:, :-1] != -100
    return {name: (value[:, :-1] if name in ("log_probs", "is_top1") else value[:, :-1] * mask)
            for name, value in fields.items()}
