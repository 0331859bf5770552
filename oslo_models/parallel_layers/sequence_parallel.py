"""Whether the forward now running is sequence-parallel: decided once per forward by the model's stack, read by
the tensor-parallel layers, never threaded through the model code.

Megatron sequence parallelism keeps the residual stream split along the sequence (``[b, s/tp, h]``) between the
tensor-parallel regions. Whether a given forward runs it depends on the call (a one-token decode step cannot split
its sequence), so it is not a constant of the layers. One ``SequenceParallelRegion`` lives on each
``ParallelContext``; ``OsloPreTrainedModel`` binds it to every ``SequenceParallelAware`` layer the plan built, and
the stack (``models/common/stack.py``) switches it on for the layers it runs (a pipeline stage does the same for
its layers). A layer called with an explicit ``sequence_parallel=True/False`` uses that instead (a T5
cross-attention reading the gathered encoder states inside a sequence-parallel decoder; unit tests of the layers).

Recomputation under activation checkpointing runs after the forward left the region: ``checkpoint_function``
(``models/common/checkpointing.py``) captures the switch at the forward and restores it around the recompute.
"""
from __future__ import annotations


class SequenceParallelRegion:
    """The per-context switch (``active``: the residual stream is ``[b, s/tp, h]`` in the layers running now).

    ``enter(active)`` returns the previous value for ``leave``; callers pair them in ``try/finally`` (plain
    attribute writes, which ``torch.compile`` traces without a graph break)."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = False

    def enter(self, active: bool) -> bool:
        previous, self.active = self.active, bool(active)
        return previous

    def leave(self, previous: bool) -> None:
        self.active = previous

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


def bind_sequence_parallel_region(model, region: SequenceParallelRegion) -> None:
    """Hand ``region`` to every ``SequenceParallelAware`` module of ``model``."""
    for module in model.modules():
        if isinstance(module, SequenceParallelAware):
            module.sequence_parallel_region = region
