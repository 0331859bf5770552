"""``OpsSeen``: which operators actually ran inside a block, seen by a ``TorchDispatchMode`` (no patching).

    with OpsSeen() as seen:
        model(ids)
    assert not seen.named("oslo_models")   # no fused Triton kernel ran

Custom ops registered with ``torch.library`` (the fused kernels are ``torch.ops.oslo_models.*``) pass through the
dispatcher like aten ops, so the mode sees exactly the kernels the dispatch rule chose, forward and backward.
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(f"{func.namespace}::{func._opname}")
        return func(*args, **(kwargs or {}))

    def named(self, namespace: str) -> list[str]:
        """The ops of ``namespace`` that ran, in order."""
        return [op for op in self.ops if op.startswith(namespace + "::")]
