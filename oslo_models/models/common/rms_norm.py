"""T5's layer norm: RMS normalization with a scale and no bias (``transformers``' ``T5LayerNorm``), plain and
sequence-parallel, with the plan style that swaps one for the other."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...parallel_layers.mappings import copy_to_tensor_parallel_region
from ...parallel_layers.plan import Style


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dim; the statistic in fp32, the product in the
    weight's dtype when that is half precision (exactly ``T5LayerNorm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(weight.dtype)
        return weight * x

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        return self._norm(x, self.weight)


class SequenceParallelRMSNorm(RMSNorm):
    """``RMSNorm`` whose replicated weight sees only this rank's tokens under sequence parallelism.

    Forward: none. Backward: all-reduce of the weight gradient over the TP group for sequence-parallel calls.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, group, device=None, dtype=None):
        super().__init__(hidden_size, eps, device=device, dtype=dtype)
        self.group = group

    @classmethod
    def from_plain(cls, module: RMSNorm, group) -> "SequenceParallelRMSNorm":
        weight = module.weight
        return cls(weight.shape[0], module.variance_epsilon, group=group, device=weight.device, dtype=weight.dtype)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        weight = copy_to_tensor_parallel_region(self.weight, self.group) if sequence_parallel else self.weight
        return self._norm(x, weight)


@dataclass(frozen=True)
class SequenceParallelRMSNormStyle(Style):
    hf_style = "sequence_parallel"

    def build(self, module, context):
        return SequenceParallelRMSNorm.from_plain(module, context.tp_group)
