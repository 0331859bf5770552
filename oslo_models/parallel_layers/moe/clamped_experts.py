"""gpt-oss's experts: stacked, with biases, an interleaved gate|up projection and a clamped SwiGLU.

Layout and keys are ``transformers``' ``GptOssExperts`` (input-major, unlike ``StackedExperts``):

- ``gate_up_proj [E, h, 2i]`` with gate and up *interleaved* along the last dim (gate ``[..., ::2]``, up
  ``[..., 1::2]``), ``gate_up_proj_bias [E, 2i]``;
- ``down_proj [E, i, h]``, ``down_proj_bias [E, h]``.

Per expert: ``gate, up = (x @ W_gu + b_gu)[::2], [1::2]``; ``gate = min(gate, limit)``, ``up = clamp(up, -limit,
limit)``; ``out = ((up + 1) * gate * sigmoid(alpha * gate)) @ W_d + b_d``.

Under expert parallelism all four tensors are split along dim 0 (experts) over ``ep`` (``ExpertParallel``: rank
``r`` holds experts ``r*E/ep .. (r+1)*E/ep``, biases included), so the interleaving, which lives inside one expert's
last dim, is never cut. By default not split over tensor parallelism (see ``experts.py``: every tp rank of an ep
rank holds the same experts and runs the same tokens).

Expert tensor parallelism (``etp = k``): ``gate_up_proj`` and its bias keep contiguous blocks of ``2i/k`` along
the last dim (whole gate|up pairs: units ``r*i/k .. (r+1)*i/k``), ``down_proj`` the same units' rows; the partial
outputs are summed over etp. ``down_proj_bias`` stays whole on every etp rank and is added once, by etp rank 0;
its gradient is all-reduced over etp (``copy_to_tensor_parallel_region``), so every rank holds the same bias.

The local experts run dropless through one grouped matmul per projection, each row getting its expert's biases
(``_GroupedExperts``, ``grouped_mm.py``); in the padded baseline the zero rows that pad an expert to ``C`` get the
bias but their outputs are dropped, so they add nothing to any gradient.
"""
from __future__ import annotations

import torch
from torch import nn

from ..mappings import copy_to_tensor_parallel_region, group_rank
from ..sharding import EvenSplit
from .experts import _GroupedExperts


class ClampedSwigluExperts(_GroupedExperts):
    """``E`` gpt-oss experts in stacked weights (see the module docstring)."""

    weight_names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    etp_layouts = {"gate_up_proj": EvenSplit(2, axis="etp"), "gate_up_proj_bias": EvenSplit(1, axis="etp"),
                   "down_proj": EvenSplit(1, axis="etp")}
    etp_replicated = ("down_proj_bias",)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, alpha: float, limit: float):
        super().__init__(num_experts)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[..., 2i]`` interleaved gate|up -> ``[..., i]`` (``GptOssExperts._apply_gate``)."""
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def run(self, x: torch.Tensor, grouping) -> torch.Tensor:
        gate_up = grouping.mm(x, self.weight("gate_up_proj")) + grouping.bias(self.weight("gate_up_proj_bias"))
        hidden = self.clamped_swiglu(gate_up)  # [..., i]
        return grouping.mm(hidden, self.weight("down_proj")) + grouping.bias(self.output_bias())  # [..., h]

    def output_bias(self) -> torch.Tensor:
        """``down_proj_bias [E_l, h]``; under etp added by etp rank 0 only (the outputs are summed over etp)."""
        bias = self.weight("down_proj_bias")
        if self.etp_group is None:
            return bias
        bias = copy_to_tensor_parallel_region(bias, self.etp_group)  # backward: all-reduce over etp
        return bias if group_rank(self.etp_group) == 0 else bias * 0.0
