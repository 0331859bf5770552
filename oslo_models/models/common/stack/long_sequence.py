"""The long-sequence memory options of a native model, applied once at construction from ``ParallelConfig`` (as
``activation_checkpointing`` is) or later by these functions:

- ``tiled_mlp`` (``apply_tiled_mlp``): every decoder block runs its feed-forward in sequence slices recomputed in
  the backward (``parallel_layers/tiled_mlp.py``), so no ``[b, s, ffn]`` tensor is whole. Decoder blocks whose
  feed-forward is the ``mlp`` role of a block template (every native causal decoder but OPT's block-level
  ``fc1``/``fc2``); refused with the reason for MoE blocks (the router's statistics are per call), encoders (their
  feed-forward is two modules) and encoder-decoders.
- ``activation_offload`` (``apply_activation_offload``): what each block saves for its backward lives in host
  memory between forward and backward (``training/activation_offload.py``). Not together with activation
  checkpointing (a checkpointed block saves only its input: ``activation_checkpointing="offload"`` keeps that
  input on the host).
- the tiled loss is the heads' ``skip_logits=True`` (``fused_ops/fused_linear_cross_entropy.py``: the LM head and the
  cross-entropy in row chunks, no ``[s, vocab]`` logits): a forward argument, nothing to apply.

The planner counts each (``planner/memory.py``).
"""
from __future__ import annotations

from transformers.modeling_layers import GradientCheckpointingLayer

from ....parallel_layers.tiled_mlp import check_tiles_setting
from .blocks import BlockTemplate


def apply_long_sequence_options(model) -> None:
    """``ParallelConfig.tiled_mlp`` and ``activation_offload`` on ``model`` (an ``OsloPreTrainedModel``)."""
    config = model.parallel_context.config
    if getattr(config, "tiled_mlp", None) is not None:
        apply_tiled_mlp(model, config.tiled_mlp)
    offload = getattr(config, "activation_offload", False)
    if offload is not None and offload is not False:  # 0 is a threshold: every tensor moves
        apply_activation_offload(model, offload)


def _blocks(model) -> list:
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def apply_tiled_mlp(model, setting) -> None:
    """Run every block's feed-forward in ``setting`` sequence slices (an int, or ``"auto"``: ``ceil(s / h)``);
    ``None`` turns it off. ``NotImplementedError`` (before anything changes) for a model it does not apply to."""
    check_tiles_setting(setting)
    name = type(model).__name__
    if setting is not None:
        if getattr(model.config, "is_encoder_decoder", False) or not getattr(model.base_model, "causal", True):
            raise NotImplementedError(f"tiled_mlp on {name}: only causal decoders are tiled (encoder feed-forwards "
                                      "are two modules; encoder-decoders are not wired)")
        for block in _blocks(model):
            if not isinstance(block, BlockTemplate) or block.part("mlp") is None:
                raise NotImplementedError(f"tiled_mlp on {name}: its block {type(block).__name__} has no feed-forward "
                                          "module of its own (the mlp role) to tile")
            if block.mlp_kwargs:
                raise NotImplementedError(f"tiled_mlp on {name}: its block {type(block).__name__} is a mixture of "
                                          "experts (the router's statistics and auxiliary loss are per call, a "
                                          "sliced call would change them)")
    for block in _blocks(model):
        if isinstance(block, BlockTemplate):
            block.mlp_tiles = setting


class _OffloadSwitch:
    """The block hooks of ``apply_activation_offload``: enter ``hooks`` before a training forward with gradients,
    leave it after (also when the forward raises)."""

    def __init__(self, hooks):
        self.hooks, self.entered = hooks, set()

    def enter(self, module, args, kwargs):
        import torch

        if module.training and torch.is_grad_enabled():
            self.hooks.__enter__()
            self.entered.add(id(module))

    def leave(self, module, args, kwargs, output):
        if id(module) in self.entered:
            self.entered.discard(id(module))
            self.hooks.__exit__(None, None, None)


def apply_activation_offload(model, setting) -> None:
    """Keep what every block saves for its backward in host memory (``True`` or a byte threshold; ``False`` / ``None``
    turns it off). ``model.activation_offload`` is the ``ActivationOffload`` hooks object (its ``moved_bytes``)."""
    from ....training.activation_offload import ActivationOffload, check_setting

    min_bytes = check_setting(setting)
    for handle in getattr(model, "_activation_offload_handles", ()):
        handle.remove()
    model._activation_offload_handles, model.activation_offload = [], None
    if min_bytes is None:
        return
    mode = (getattr(model, "activation_checkpointing_mode", None)
            or model.parallel_context.config.activation_checkpointing)
    if mode is not None:
        raise ValueError(f"activation_offload with activation_checkpointing={mode!r}: a checkpointed block saves only "
                         "its input; activation_checkpointing='offload' keeps that input in host memory")
    switch = _OffloadSwitch(ActivationOffload(min_bytes))
    for block in _blocks(model):
        model._activation_offload_handles += [
            block.register_forward_pre_hook(switch.enter, with_kwargs=True),
            block.register_forward_hook(switch.leave, with_kwargs=True, always_call=True)]
    model.activation_offload = switch.hooks
