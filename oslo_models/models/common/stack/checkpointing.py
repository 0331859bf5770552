"""Activation checkpointing: one implementation behind ``ParallelConfig.activation_checkpointing``,
``model.set_activation_checkpointing(mode)`` and ``transformers``' ``gradient_checkpointing_enable()``.

Modes (``ACTIVATION_CHECKPOINTING``):

- ``"full"``: every block (the ``GradientCheckpointingLayer`` decoder/encoder layers of every family) keeps only
  its inputs and recomputes its forward in the backward (``torch.utils.checkpoint``, non-reentrant).
- ``"selective"``: only the attention core (scores, softmax, probability dropout, ``@ V``; Megatron's selective
  recomputation) is recomputed; projections, norms and MLPs keep their activations. It runs in the shared ``attend``
  helper (``common/attention/attention.py``), so every family gets it from one place. Saves the ``[b, n/tp, s, s]``
  tensors of eager attention; with a memory-efficient SDPA/flash kernel there is little left to save.
- ``"offload"``: as ``"full"``, and the input each block keeps (its hidden states) moves to host memory in the
  forward and back in the backward (as ``torch.autograd.graph.save_on_cpu``, pinned on CUDA). On a CPU-only run the
  round trip is a copy: it is exercised for correctness and saves nothing.
- ``"partitioned"``: as ``"full"``, and each tensor-parallel rank keeps ``1/tp`` of a block's input hidden states
  (the flattened tensor cut in ``tp`` equal pieces, padded); the backward all-gathers it over the TP group before
  recomputing (DeepSpeed's ``partition_activations``, Megatron's ``distribute_saved_activations``). Without
  sequence parallelism the hidden states are replicated over the TP ranks, so this stores ``1/tp`` of them. Under
  sequence parallelism they are already split along the sequence (every rank holds different rows), so there is
  nothing more to partition: the mode then stores what ``"full"`` stores. Only the 1D tensor-parallel mode.

Only a block's first positional input (its hidden states) is offloaded or partitioned: masks, position biases,
rotary tables and encoder states are shared by every layer and stay alive anyway.

Every mode composes with the tensor-parallel RNG tracker: the checkpoint function is wrapped by
``RNGTracker.checkpointed``, so dropout drawn from the tensor-parallel stream (attention probabilities of this
rank's heads, sequence-parallel slices) is replayed identically on recompute; torch's checkpoint replays the default
stream. Pipeline stages call the same blocks, so their layers checkpoint the same way.

Collectives: ``"partitioned"`` runs one all-gather over the TP group per checkpointed block in the backward (before
its recompute); the recompute repeats the block's forward collectives, as any full recompute does.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from ....config import _ACTIVATION_CHECKPOINTING

ACTIVATION_CHECKPOINTING = _ACTIVATION_CHECKPOINTING
_BLOCK_MODES = ("full", "offload", "partitioned")


def check_mode(mode) -> None:
    """``ValueError`` unless ``mode`` is ``None`` or one of ``ACTIVATION_CHECKPOINTING``."""
    if mode is not None and mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={mode!r} is unknown; choose None or one of "
                         f"{ACTIVATION_CHECKPOINTING}")


class PartitionedActivation:
    """This rank's ``1/tp`` piece of a saved tensor: ``shard`` is a fresh ``[ceil(numel/tp)]`` tensor (its own
    storage, so the full tensor can be freed), ``shape`` the full shape."""

    __slots__ = ("shard", "shape", "numel")

    def __init__(self, tensor: torch.Tensor, rank: int, size: int):
        self.shape, self.numel = tensor.shape, tensor.numel()
        per_rank = -(-self.numel // size)
        flat = tensor.detach().reshape(-1)
        start, stop = min(rank * per_rank, self.numel), min((rank + 1) * per_rank, self.numel)
        self.shard = flat.new_zeros(per_rank)
        self.shard[:stop - start].copy_(flat[start:stop])

    def gather(self, group, size: int) -> torch.Tensor:
        """All-gather the pieces of every TP rank back into the full tensor (collective over ``group``)."""
        pieces = [torch.empty_like(self.shard) for _ in range(size)]
        dist.all_gather(pieces, self.shard, group=group)
        return torch.cat(pieces)[:self.numel].view(self.shape)


class _FirstInputHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks active only while the checkpoint saves its inputs (inside the checkpointed forward torch's
    own hooks take over): ``pack``/``unpack`` apply to the block's hidden states, other inputs are kept as they are."""

    def __init__(self, first: torch.Tensor, pack: Callable, unpack: Callable):
        def pack_hook(tensor):
            if tensor is first or (tensor.data_ptr() == first.data_ptr() and tensor.shape == first.shape):
                return True, pack(tensor)
            return False, tensor

        def unpack_hook(packed):
            transformed, value = packed
            return unpack(value) if transformed else value

        super().__init__(pack_hook, unpack_hook)


class OffloadedActivation:
    """A saved tensor moved to host memory: ``host`` (pinned when it came from CUDA) and the ``device`` to bring it
    back to. The copies are asynchronous on CUDA (pinned memory, ``non_blocking``), on the current stream."""

    __slots__ = ("host", "device")

    def __init__(self, tensor: torch.Tensor):
        self.device = tensor.device
        pin = tensor.device.type == "cuda"
        self.host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        self.host.copy_(tensor, non_blocking=pin)

    def restore(self) -> torch.Tensor:
        return self.host.to(self.device, non_blocking=self.host.is_pinned())


def _offload_hooks(first: torch.Tensor):
    return _FirstInputHooks(first, OffloadedActivation, OffloadedActivation.restore)


def _partition_hooks(first: torch.Tensor, context):
    group, rank, size = context.tp_group, context.tp_rank, context.tp_size
    return _FirstInputHooks(first, lambda t: PartitionedActivation(t, rank, size),
                            lambda part: part.gather(group, size))


def checkpoint_function(context, mode: str = "full", base: Callable | None = None) -> Callable:
    """The function that checkpoints one call, ``fn(function, *args) -> function(*args)``, for ``mode``.

    ``base``: the checkpoint to wrap (default ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; the
    offload and partitioned modes need the non-reentrant one, which saves its inputs through saved-tensor hooks).
    The result replays the tensor-parallel dropout stream of ``context`` on recompute.
    """
    check_mode(mode)
    if base is None:
        base = functools.partial(_torch_checkpoint, use_reentrant=False)
    replaying = _keeping_sequence_parallel(context.rng.checkpointed(base), context.sequence_parallel_region)
    if mode in ("full", "selective"):
        return replaying
    if mode == "partitioned" and context.is_grid:
        raise ValueError(f"activation_checkpointing='partitioned' needs tensor_parallel_mode='1d', got "
                         f"{context.tensor_parallel_mode!r} (grid modes already split the hidden states)")

    def checkpoint_block(function, *args, **kwargs):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None or not torch.is_grad_enabled():
            return replaying(function, *args, **kwargs)
        if mode == "offload":
            hooks = _offload_hooks(first)
        elif context.tp_size > 1 and not context.sequence_parallel_region.active:
            hooks = _partition_hooks(first, context)
        else:  # one TP rank, or sequence parallelism: the input is already this rank's only copy
            return replaying(function, *args, **kwargs)
        with hooks:
            return replaying(function, *args, **kwargs)

    return checkpoint_block


def _keeping_sequence_parallel(checkpoint: Callable, region) -> Callable:
    """``checkpoint`` whose recompute sees the sequence-parallel switch the forward saw: the backward runs after the
    stack left its region, so the recomputed function re-enters the value captured here."""

    def checkpoint_in_region(function, *args, **kwargs):
        active = region.active
        return checkpoint(functools.partial(region.run, active, function), *args, **kwargs)

    return checkpoint_in_region


def apply_activation_checkpointing(model, mode: str | None, base: Callable | None = None, **layer_kwargs) -> None:
    """Switch ``model`` (an ``OsloPreTrainedModel``) to ``mode`` (``None``: off).

    Block modes set ``gradient_checkpointing`` and ``_gradient_checkpointing_func`` on every
    ``GradientCheckpointingLayer`` through ``transformers``' own ``_set_gradient_checkpointing`` (``layer_kwargs``,
    e.g. ``every_n_layers``, go to it); ``"selective"`` turns them off and hands the checkpoint function to every
    ``AttentionModule`` (read by ``attend``). Checkpointing acts in training mode only, as in ``transformers``.
    """
    from transformers import PreTrainedModel

    from ..attention.attention import AttentionModule

    check_mode(mode)
    function = checkpoint_function(model.parallel_context, mode, base) if mode is not None else None
    block_function = function if mode in _BLOCK_MODES else (base or _torch_checkpoint)
    PreTrainedModel._set_gradient_checkpointing(model, enable=mode in _BLOCK_MODES,
                                                gradient_checkpointing_func=block_function, **layer_kwargs)
    for module in model.modules():
        if isinstance(module, AttentionModule):
            module.core_checkpoint = function if mode == "selective" else None
    model.activation_checkpointing_mode = mode


def apply_block_checkpointing(model, flags) -> None:
    """Checkpoint (mode ``"full"``) exactly the blocks whose flag is set, one flag per ``GradientCheckpointingLayer``
    in module order (``ParallelConfig.block_plan``'s ``checkpoint`` keys); ``ValueError`` when the counts differ."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if len(layers) != len(flags):
        raise ValueError(f"ParallelConfig.block_plan has {len(flags)} entries but {type(model).__name__} has "
                         f"{len(layers)} checkpointable blocks; give one entry per block")
    function = checkpoint_function(model.parallel_context, "full")
    for layer, flag in zip(layers, flags):
        layer.gradient_checkpointing = bool(flag)
        layer._gradient_checkpointing_func = function
