"""RMS normalization with a scale and no bias, plain and tensor-/sequence-parallel, with the plan style that swaps
one for the other.

Four ``formula``s, each exactly its ``transformers`` twin (the first three differ only in where half precision
rounds):

- ``"t5"`` (``T5LayerNorm``): the statistic in fp32, the product in the weight's dtype when that is half precision;
- ``"llama"`` (``LlamaRMSNorm``, and Mistral/Qwen2/Qwen3's copies): normalize in fp32, round to the input's dtype,
  then scale. This one can run the fused Triton kernel (``fused_ops.rms_norm``) when ``fused`` (set when the model
  is built: ``common/stack/fused_kernels.py``); the
  dispatcher takes the kernel on CUDA (or under ``OSLO_FUSED_OPS=force``) and the same formula in torch elsewhere;
- ``"olmo2"`` (``Olmo2RMSNorm``): normalize and scale in fp32, round the product to the input's dtype;
- ``"gemma"`` (``GemmaRMSNorm``, Gemma 1/2/3): ``x * (1 + weight)``, all in fp32, rounded to the input's dtype.
  The weight is stored as the offset from one, so a fresh norm holds zeros (as ``transformers``').

The grid modes (2D/2.5D/3D) split a residual-stream norm over the hidden (``RMSNorm2D``, every formula).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .... import fused_ops
from ....parallel_layers.mappings import copy_to_tensor_parallel_region
from ....parallel_layers.plan import Style, build_grid_layer
from ....parallel_layers.sequence_parallel import SequenceParallelAware
from ..stack.fused_kernels import FusedKernels

FORMULAS = ("t5", "llama", "olmo2", "gemma")


class RMSNorm(FusedKernels, nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dim (see the module docstring for ``formula``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, formula: str = "t5", device=None, dtype=None):
        super().__init__()
        if formula not in FORMULAS:
            raise ValueError(f"RMSNorm formula must be one of {FORMULAS}, got {formula!r}")
        init = torch.zeros if formula == "gemma" else torch.ones  # gemma stores ``weight - 1``
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.formula = formula

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.formula == "llama":
            return fused_ops.rms_norm(x, weight, self.variance_epsilon, enabled=self.fused)
        if self.formula in ("olmo2", "gemma"):
            normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            scale = 1.0 + weight.float() if self.formula == "gemma" else weight.float()
            return (normed * scale).to(x.dtype)
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(weight.dtype)
        return weight * x

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        return self._norm(x, self.weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, formula={self.formula}"


class SequenceParallelRMSNorm(SequenceParallelAware, RMSNorm):
    """``RMSNorm`` whose replicated weight sees only part of what it normalizes on each tensor-parallel rank.

    - Residual-stream norms (default): under sequence parallelism each rank normalizes its slice of the tokens.
    - ``always_reduce=True``: norms inside the tensor-parallel region (Qwen3's ``q_norm``/``k_norm`` over
      ``head_dim``) see only this rank's heads, with or without sequence parallelism.

    Forward: none. Backward: all-reduce (sum) of the weight gradient over the TP group when the call is partial.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, group, always_reduce: bool = False,
                 formula: str = "t5", device=None, dtype=None):
        super().__init__(hidden_size, eps, formula=formula, device=device, dtype=dtype)
        self.group, self.always_reduce = group, always_reduce

    @classmethod
    def from_plain(cls, module: RMSNorm, group, *, always_reduce: bool = False,
                   fused: bool | None = None) -> "SequenceParallelRMSNorm":
        weight = module.weight
        norm = cls(weight.shape[0], module.variance_epsilon, group=group, always_reduce=always_reduce,
                   formula=getattr(module, "formula", "t5"), device=weight.device, dtype=weight.dtype)
        norm.fused = module.fused if fused is None else fused
        return norm

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        partial = self.always_reduce or self.sequence_parallel_active(sequence_parallel)
        weight = copy_to_tensor_parallel_region(self.weight, self.group) if partial else self.weight
        return self._norm(x, weight)


@dataclass(frozen=True)
class SequenceParallelRMSNormStyle(Style):
    """Plan style of an RMS norm: replicated weight, gradient summed over TP where each rank saw part of the data
    (see ``SequenceParallelRMSNorm``). The fused kernel follows ``ParallelConfig.fused_ops``."""

    always_reduce: bool = False

    @property
    def hf_style(self) -> str:
        return "replicated_with_grad_allreduce" if self.always_reduce else "sequence_parallel"

    def build(self, module, context):
        if context.is_grid and not self.always_reduce:  # an RMS norm over the split hidden
            return build_grid_layer("rms_norm", module, context)
        norm = SequenceParallelRMSNorm.from_plain(module, context.tp_group, always_reduce=self.always_reduce,
                                                  fused=context.config.fused_ops)
        if context.is_grid:
            # Qwen3's q/k norms over a whole head_dim: replicated weight, and every grid rank normalizes other
            # tokens or heads, so the gradient is summed over the whole tensor-parallel group.
            norm.grid_planned = True  # laid out for the grid (see grid_boundary.check_fully_planned)
        return norm


# the plan fragment of a residual-stream RMS norm (the component carries it; see models/common/stack/blocks.py)
RMSNorm.tp_plan = {"": SequenceParallelRMSNormStyle()}
