"""Whether the forward now running is sequence-parallel: decided once per forward by the model's stack, read by
the tensor-parallel layers, never threaded through the model code.

Megatron sequence parallelism keeps the residual stream split along the sequence (``[b, s/tp, h]``) between the
tensor-parallel regions. Whether a given forward runs it depends on the call (a one-token decode step cannot split
its sequence), so it is not a constant of the layers. One ``SequenceParallelRegion`` lives on each
``ParallelContext``; ``OsloPreTrainedModel`` binds it to every ``SequenceParallelAware`` layer the plan built, and
the stack (``models/common/stack/stack.py``) switches it on for the layers it runs (a pipeline stage does the same for
its layers). A layer called with an explicit ``sequence_parallel=True/False`` uses that instead (a T5
cross-attention reading the gathered encoder states inside a sequence-parallel decoder; unit tests of the layers).

Recomputation under activation checkpointing runs after the forward left the region: ``checkpoint_function``
(``models/common/stack/checkpointing.py``) captures the switch at the forward and restores it around the recompute.

The region also shares the entry into the tensor-parallel region between the column-parallel layers that read the
same input (``enter_tensor_parallel``): q, k and v projections (or gate and up) of one block reading one norm output
all-gather it once under sequence parallelism and keep one gathered copy for backward, whose gradient is
reduce-scattered once (plain tensor parallelism: one all-reduce of the input gradient instead of one per layer), as
Megatron's fused layers do. Only while a stack runs (between ``enter`` and ``leave``), never across them.
"""
from __future__ import annotations

import torch

from .mappings import copy_to_tensor_parallel_region, gather_from_sequence_parallel_region


def enter_tensor_parallel_alone(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """``x`` entering a column-parallel layer on its own: all-gathered along the sequence (backward: reduce-scatter
    of the partial input gradients) under sequence parallelism, else copied (backward: all-reduce)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group, grad_is_partial=True)
    return copy_to_tensor_parallel_region(x, group)


class SequenceParallelRegion:
    """The per-context switch (``active``: the residual stream is ``[b, s/tp, h]`` in the layers running now).

    ``enter(active)`` returns the previous value for ``leave``; callers pair them in ``try/finally`` (plain
    attribute writes, which ``torch.compile`` traces without a graph break)."""

    __slots__ = ("active", "_depth", "_shared")

    def __init__(self) -> None:
        self.active = False
        self._depth = 0  # stacks (or recomputed blocks) running now
        self._shared = None  # (input, its version, grad mode, group, sequence parallel, entered input)

    def enter(self, active: bool) -> bool:
        previous, self.active = self.active, bool(active)
        self._depth += 1
        self._shared = None
        return previous

    def leave(self, previous: bool) -> None:
        self.active = previous
        self._depth -= 1
        self._shared = None  # nothing outlives the forward (a held graph would keep its saved tensors alive)

    def enter_tensor_parallel(self, x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
        """``x`` entering a column-parallel layer: all-gathered along the sequence (``[b, s/tp, h] -> [b, s, h]``;
        backward: reduce-scatter) under sequence parallelism, else copied (identity; backward: all-reduce). The
        layers reading the same tensor inside one stack forward share one entry (one collective each way); outside
        a stack, or while ``torch.compile`` traces, each call enters on its own."""
        # inference tensors have no version counter to check; compiled graphs stay free of the Python-side sharing
        if torch.compiler.is_compiling() or self._depth == 0 or x.is_inference():
            return enter_tensor_parallel_alone(x, group, sequence_parallel)
        grad_mode = torch.is_grad_enabled()
        shared = self._shared
        if (shared is not None and shared[0] is x and shared[1] == x._version and shared[2] == grad_mode
                and shared[3] is group and shared[4] == sequence_parallel):
            return shared[5]
        entered = enter_tensor_parallel_alone(x, group, sequence_parallel)
        self._shared = (x, x._version, grad_mode, group, sequence_parallel, entered)
        return entered

    def run(self, active: bool, function, *args, **kwargs):
        """``function(*args, **kwargs)`` with the switch at ``active``, restored afterwards."""
        previous = self.enter(active)
        try:
            return function(*args, **kwargs)
        finally:
            self.leave(previous)

    def __repr__(self) -> str:
        return f"SequenceParallelRegion(active={self.active})"


class SequenceParallelAware:
    """Mixin of the layers whose forward differs under sequence parallelism (column/row-parallel linears, norms with
    a replicated weight, dropout drawing per-rank masks). ``sequence_parallel_region`` is bound by the model
    (``bind_sequence_parallel_region``); unbound, a layer runs plain tensor parallelism unless told otherwise."""

    sequence_parallel_region: SequenceParallelRegion | None = None

    def sequence_parallel_active(self, explicit: bool | None = None) -> bool:
        if explicit is not None:
            return explicit
        region = self.sequence_parallel_region
        return region is not None and region.active

    def enter_tensor_parallel(self, x: torch.Tensor, sequence_parallel: bool | None = None) -> torch.Tensor:
        """A column-parallel layer's input entering its region over ``self.group`` (all-gathered along the sequence
        under sequence parallelism, else copied), shared with the layers reading the same tensor in this forward
        (``SequenceParallelRegion.enter_tensor_parallel``)."""
        active = self.sequence_parallel_active(sequence_parallel)
        region = self.sequence_parallel_region
        if region is None:  # a layer used outside a model: nothing to share with
            return enter_tensor_parallel_alone(x, self.group, active)
        return region.enter_tensor_parallel(x, self.group, active)


def bind_sequence_parallel_region(model, region: SequenceParallelRegion) -> None:
    """Hand ``region`` to every ``SequenceParallelAware`` module of ``model``."""
    for module in model.modules():
        if isinstance(module, SequenceParallelAware):
            module.sequence_parallel_region = region
