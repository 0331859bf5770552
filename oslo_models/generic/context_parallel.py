"""Context parallelism for generic causal LMs through ``transformers``' attention interface.

Each cp rank holds its chunk(s) of every sequence (``training.prepare``'s loader splits whole sequences, and shifts
the labels on the whole sequence first, as for the native families). Three public extension points carry the rest:

- ``AttentionInterface``: :func:`context_parallel_attention` is registered as the attention function
  ``"oslo_context_parallel"`` (stateless: everything it needs arrives with the call) and set as the model's
  ``attn_implementation``. It runs the ring or all-to-all core of ``parallel_layers/context_parallel`` over the cp
  group, with the causal mask, sliding window, padding and packed documents of the *global* positions;
- a forward pre-hook on the model: the global ``position_ids`` of the rank's tokens (rotary and learned positions see
  where each token really is; packed documents' restarting positions are kept as given), the ``ContextParallelMask``
  of the batch (one all-gather of the padding mask over cp, one of the positions for packed rows) handed to the
  attention function as the keyword ``oslo_context_parallel`` (``transformers``' decoders pass their keyword
  arguments down to the attention interface), no 2D ``attention_mask`` (the cp mask replaces it) and no cache;
- the loss: ``transformers``' own, on ``shift_labels`` (the loader's), divided by ``num_items_in_batch``: each rank
  returns its chunk's share, and the gradient average over ``dp x cp`` sums the shares (``training/global_batch.py``);
  an MoE's load-balancing loss (``output_router_logits``) is made the replica's (``router_loss.py``).

Checked at load by one dummy forward at cp (every cp rank): every decoder layer must attend through the interface
and pass the keyword on (a state-space / linear-attention layer, or attention code of its own, would see only its
chunk). Soft-capping (scores capped inside each block) and attention sinks (joined once at the final merge) run in
the cores. Refusals are ``NotImplementedError``
naming the reason. Collectives per forward: the mask's all-gathers, and the cores' (ring: ``cp - 1`` key/value
exchanges per layer; all-to-all: two per layer).
"""
from __future__ import annotations

from torch import nn

from . import router_loss
from .install_state import update_generic_install

ATTENTION_NAME = "oslo_context_parallel"
KEYWORD = "oslo_context_parallel"


class ContextParallelCall:
    """What the hook hands each attention call: the batch's ``ContextParallelMask``, a count of the calls, and the
    chunk's padding mask ``[b, s_chunk]`` (or ``None``; read by ``router_loss.py``)."""

    def __init__(self, mask, padding=None):
        self.mask, self.calls, self.padding = mask, 0, padding


def context_parallel_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                               sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """``transformers``' attention-interface signature; see the module docstring."""
    from ..parallel_layers.context_parallel.attention import context_parallel_attention as core

    call = kwargs.get(KEYWORD)
    if call is None:
        raise NotImplementedError(f"{type(module).__name__} called the context-parallel attention without the "
                                  f"context-parallel mask: the model does not pass its keyword arguments on to "
                                  f"its attention, so its chunks cannot attend across the cp group")
    call.calls += 1
    # soft-capping inside each block; sinks [n] of this rank's heads joined once at the final merge
    return core(module, query, key, value, call.mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
                softcap=softcap, s_aux=s_aux)


def register() -> None:
    """Add the attention function to ``transformers``' interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)


def chunk_inputs(context, kwargs: dict, shape_like) -> dict:
    """The forward's keyword arguments for this rank's chunk(s) ``shape_like`` ``[b, s_chunk(, h)]``: global
    ``position_ids`` (kept when given: packed documents), the batch's ``ContextParallelMask`` under ``KEYWORD`` (one
    all-gather of the padding mask over cp, one of the positions for packed rows), no ``attention_mask``, no cache.
    What the model's pre-hook applies, and what a pipeline stage (which calls the class's forward directly,
    ``pipeline_stage.py``) applies itself."""
    from ..parallel_layers.context_parallel.chunking import token_index
    from ..parallel_layers.context_parallel.mask import build_context_parallel_mask

    kwargs = dict(kwargs)
    batch, seq_local = shape_like.shape[:2]
    position_ids = kwargs.get("position_ids")
    mask = build_context_parallel_mask(context, kwargs.get("attention_mask"), shape_like, causal=True,
                                       position_ids=position_ids)
    if position_ids is None:
        index = token_index(seq_local, context.cp_rank, context.cp_size, context.config.context_parallel_mode,
                            device=shape_like.device)
        kwargs["position_ids"] = index.unsqueeze(0).expand(batch, -1)
    kwargs[KEYWORD] = ContextParallelCall(mask, kwargs.get("attention_mask"))
    kwargs["attention_mask"] = None
    kwargs["use_cache"] = False
    return kwargs


def _before(model, context):
    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        return args, chunk_inputs(context, kwargs, ids if ids is not None else kwargs["inputs_embeds"])

    return hook


def _pipelined_calls(model, context) -> tuple[int, int]:
    """``(attention calls, layers)`` of this rank's pipeline stages run once on the dummy tokens (each stage
    applies :func:`chunk_inputs` itself; ``pipeline_stage.py``)."""
    from .dummy_forward import dummy_forward

    calls = []
    update_generic_install(model, context_parallel_calls=calls)  # each stage appends its ContextParallelCall
    try:
        dummy_forward(model, context, grad=False)
    finally:
        update_generic_install(model, context_parallel_calls=None)
    return sum(call.calls for call in calls), len(model.pipeline_layout.local_layers())


def install(model: nn.Module, context) -> None:
    """Register the attention function, switch the model to it and add the pre-hook; then check every decoder layer
    attends through it (one dummy forward over the cp group)."""
    from .dummy_forward import dummy_forward
    from .sequence_parallel import decoder_layers
    from .support import is_image_text

    if is_image_text(model.config, type(model)):  # split after the vision features' merge (image_text/)
        from ..image_text.context_parallel import install as install_image_text

        return install_image_text(model, context)
    if getattr(model, "loss_type", None) != "ForCausalLM":
        raise NotImplementedError(f"context_parallel_size={context.cp_size}: the generic path splits the sequence "
                                  f"of causal LMs; {type(model).__name__} is not one")
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    if getattr(model, "pipeline_layout", None) is not None:  # each stage applies chunk_inputs in its own forward
        calls, layers = _pipelined_calls(model, context)
        if calls < layers:
            raise NotImplementedError(
                f"context_parallel_size={context.cp_size}: {calls} of the {layers} layers of this rank's pipeline "
                f"stages of {type(model).__name__} attend through transformers' attention interface; the others "
                f"(state-space or linear-attention layers, or attention code of their own) would see only this "
                f"rank's chunk of the sequence")
        router_loss.check_pipeline(model)  # under pp the stages carry the router statistics (router_loss.py)
        return
    handle = model.register_forward_pre_hook(_before(model, context), with_kwargs=True)
    seen = []
    probe = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs[KEYWORD]),
                                            with_kwargs=True)
    try:
        dummy_forward(model, context, grad=False)
    except BaseException:
        handle.remove()
        raise
    finally:
        probe.remove()
    layers = len(decoder_layers(model))
    if not seen or seen[0].calls < layers:
        handle.remove()
        raise NotImplementedError(
            f"context_parallel_size={context.cp_size}: {seen[0].calls if seen else 0} of the {layers} layers of "
            f"{type(model).__name__} attend through transformers' attention interface; the others (state-space or "
            f"linear-attention layers, or attention code of their own) would see only this rank's chunk of the "
            f"sequence")
    router_loss.install(model, context, KEYWORD)  # an MoE's load-balancing loss over the replica's tokens
