"""What a rank really holds, counted from its tensors: the measured counterparts of ``memory.py``'s predictions,
to check a plan on the machine that runs it (``benchmarks/planner_ranking.py``; ``tests/planner``).

- ``state_bytes(model, optimizer)``: ``(parameters, gradients, optimizer state)`` bytes of this rank's LOCAL tensors
  (a DTensor counts its local shard; ZeRO-1's ``ZeroRedundancyOptimizer`` the state of the parameters this rank
  owns; Accelerate's optimizer wrapper and the expert-parallel split optimizer are looked through), after a step.
  ``memory.training_state`` predicts the same three numbers.
- ``saved_activation_bytes(model, batch)``: bytes of the distinct storages autograd's saved-tensor hooks see in one
  forward, the rank's own parameters excluded (``memory.activation_bytes`` predicts them). A FSDP2 (ZeRO-2/3) model
  saves its unsharded weights for backward, which are not activations: measure it unwrapped.

No collective runs here.
"""
from __future__ import annotations

import torch


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _local_bytes(tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _optimizer_states(optimizer) -> list:
    """Every per-parameter state dict this rank's optimizer holds (inside ZeRO-1 / the expert split)."""
    from ..training import unwrap_optimizer

    optimizer = unwrap_optimizer(optimizer)  # Accelerate's wrapper
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer: the local optimizer of owned tensors
    if inner is not None:
        return _optimizer_states(inner)
    if hasattr(optimizer, "inner"):
        return [s for opt, _ in optimizer.inner for s in _optimizer_states(opt)]
    return list(optimizer.state.values())


def state_bytes(model, optimizer) -> tuple[int, int, int]:
    """``(parameters, gradients, optimizer state)`` bytes of this rank's local tensors."""
    params = list(model.parameters())
    return (sum(_local_bytes(p) for p in params),
            sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            sum(_local_bytes(v) for state in _optimizer_states(optimizer) for v in state.values()
                if isinstance(v, torch.Tensor)))


def saved_activation_bytes(model, batch: dict) -> int:
    """Bytes of the distinct storages the saved-tensor hooks see in one forward (the rank's parameters excluded)."""
    weights = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**batch)
    return sum(saved.values())
