"""Choose between a Triton kernel and its torch reference.

Rule (``use_triton``):

1. ``force_triton=True`` always takes the Triton path (tests use it on CPU tensors with ``TRITON_INTERPRET=1``);
   it raises ``ValueError`` when that path cannot run (no Triton, or CPU tensors without the interpreter).
   ``OSLO_FUSED_OPS=force`` does the same for every op a model calls with ``enabled=True`` (how the model-level
   tests run the kernels on CPU under the interpreter).
2. Otherwise the Triton path runs only when all of these hold: the caller passed ``enabled=True`` (models pass
   ``ParallelConfig.fused_ops``), the environment does not say ``OSLO_FUSED_OPS=0`` (a debugging switch that
   beats the config), Triton imports, every tensor is on CUDA, and ``torch.compile`` is not tracing the call.
   Under compile the references let Inductor fuse across op boundaries, which the opaque custom ops prevent:
   GPT-2 350M on an H200 (bf16, BENCHMARKS.md) trained at 124.5k tokens/s with the kernels inside the graph
   and 153.4k with the references (compiled transformers: 151.8k), at lower peak memory.
3. Everything else runs the plain-torch reference, which computes the same function.

There is no global switch to flip: the decision is a pure function of its arguments and the environment, so
two models with different settings can live in one process.
"""
from __future__ import annotations

import os

import torch

from oslo_models.fused_ops._utils import HAS_TRITON, interpreter_enabled

ENV_VAR = "OSLO_FUSED_OPS"
_OFF_VALUES = ("0", "false", "off", "no")


def env_enabled() -> bool:
    """False when ``OSLO_FUSED_OPS`` is set to 0/false/off/no (case-insensitive)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF_VALUES


def env_forces() -> bool:
    """True when ``OSLO_FUSED_OPS=force`` (every enabled op takes its Triton kernel)."""
    return os.environ.get(ENV_VAR, "").strip().lower() == "force"


def triton_available() -> bool:
    return HAS_TRITON


def use_triton(*tensors: torch.Tensor | None, enabled: bool = True, force_triton: bool = False) -> bool:
    """Whether an op called on ``tensors`` (``None`` entries are skipped) should run its Triton kernel."""
    present = [t for t in tensors if t is not None]
    if enabled and env_forces():
        force_triton = True
    if force_triton:
        if not HAS_TRITON:
            raise ValueError("force_triton=True but triton cannot be imported")
        if not all(t.is_cuda for t in present) and not interpreter_enabled():
            raise ValueError("force_triton=True on CPU tensors needs TRITON_INTERPRET=1 (set before importing "
                             "oslo_models.fused_ops) or CUDA tensors")
        return True
    if not enabled or not env_enabled() or not HAS_TRITON or torch.compiler.is_compiling():
        return False
    return bool(present) and all(t.is_cuda for t in present)
