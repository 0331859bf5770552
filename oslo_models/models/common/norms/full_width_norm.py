"""An RMS norm over a whole head-split projection output (OLMo 2's ``q_norm``/``k_norm``), and its tensor-parallel
version, whose statistic is all-reduced over the ranks that each hold some of the heads.

OLMo 2 normalizes the *whole* ``q_proj`` output ``[b, s, n*d]`` (and ``k_proj``'s ``[b, s, n_kv*d]``) before the
heads are split, with ``Olmo2RMSNorm`` (the ``"olmo2"`` formula: normalize and scale in fp32, round to the input's
dtype) and a weight of ``n*d``. Under tensor parallelism ``q_proj`` is column-parallel, so a rank holds only its
``n/tp`` heads: ``[b, s, (n/tp)*d]``. ``TensorParallelFullWidthRMSNorm`` then

- holds this rank's slice of the weight, split like the projection's output (``HeadSplit(0, ...)``:
  ``n/tp`` whole heads per rank; for key/value heads at ``tp > n_kv`` one head replicated on ``tp/n_kv`` ranks);
- computes the local sum of squares ``[b, s, 1]`` and **all-reduces it over TP** (forward: all-reduce; backward:
  all-reduce, since every rank's output depends on every rank's input), divided by the summed local widths. With
  replicated heads every head is counted ``tp/n_kv`` times in both sum and width, so the mean is the true one;
- replicated heads: the weight gradient of each copy sees only its own rank's query heads, so it is summed over
  the replica group (``tp_subgroup(tp/n_kv)``), as ``KVHeadColumnParallelLinear`` does for ``k_proj``.

Collectives per call: one all-reduce of ``[b, s, 1]`` forward and one backward (plus the replica-group all-reduce of
the weight gradient when key/value heads are replicated). Under 2D / 2.5D the projection's output is split
over the hidden like the stream, and the stream's ``RMSNorm2D`` (formula ``"olmo2"``) is this norm; 3D is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ....parallel_layers.mappings import copy_to_tensor_parallel_region, group_size, reduce_from_tensor_parallel_region
from ....parallel_layers.plan import Style, refuse_grid_mode
from ....parallel_layers.sharding import HeadSplit
from ....parallel_layers.summa import Grid
from ....parallel_layers.tensor_parallel_2d import RMSNorm2D


def _olmo2_rms(x: torch.Tensor, weight: torch.Tensor, variance: torch.Tensor, eps: float) -> torch.Tensor:
    return (weight.float() * (x.float() * torch.rsqrt(variance + eps))).to(x.dtype)


class FullWidthRMSNorm(nn.Module):
    """``Olmo2RMSNorm`` over ``hidden_size = num_heads * head_dim`` (the last dim of ``[b, s, hidden_size]``); the
    ``num_heads`` tell the plan how the weight may be split. Single device: exactly ``Olmo2RMSNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, num_heads: int, device=None, dtype=None):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not {num_heads} equal heads")
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon, self.num_heads = eps, num_heads

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return _olmo2_rms(x, self.weight, variance, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, heads={self.num_heads}"


class TensorParallelFullWidthRMSNorm(FullWidthRMSNorm):
    """``FullWidthRMSNorm`` on this rank's heads ``[b, s, local]``, statistic all-reduced over ``group`` (see the
    module docstring). ``full_hidden``: the unsplit width the weight stands for."""

    def __init__(self, full_hidden: int, eps: float = 1e-6, *, num_heads: int, group, replica_group=None,
                 device=None, dtype=None):
        spec = HeadSplit(0, num_heads)
        tp = group_size(group)
        local = spec.local_shape((full_hidden,), tp)[0]
        super().__init__(local, eps, num_heads=max(num_heads // tp, 1), device=device, dtype=dtype)
        self.full_hidden, self.full_heads = full_hidden, num_heads
        self.group = group
        self.replica_group = replica_group if spec.replicas(tp) > 1 else None

    @classmethod
    def from_plain(cls, module: FullWidthRMSNorm, group, *, replica_group=None) -> "TensorParallelFullWidthRMSNorm":
        weight = module.weight
        return cls(weight.shape[0], module.variance_epsilon, num_heads=module.num_heads, group=group,
                   replica_group=replica_group, device=weight.device, dtype=weight.dtype)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        local_sum = x.float().pow(2).sum(-1, keepdim=True)  # [b, s, 1]
        # forward all-reduce, backward all-reduce (identity then copy's all-reduce)
        total = reduce_from_tensor_parallel_region(copy_to_tensor_parallel_region(local_sum, self.group), self.group)
        variance = total / (x.shape[-1] * group_size(self.group))
        weight = self.weight
        if self.replica_group is not None:
            weight = copy_to_tensor_parallel_region(weight, self.replica_group)  # backward: sum the copies
        return _olmo2_rms(x, weight, variance, self.variance_epsilon)


@dataclass(frozen=True)
class FullWidthRMSNormStyle(Style):
    """Plan style of a ``FullWidthRMSNorm``: weight split by heads like the projection it follows (``q_proj``:
    ``Colwise``; ``k_proj``: ``KVHeadColwise``), statistic all-reduced over TP. 1D only."""

    hf_style = None  # none in transformers (its OLMo 2 plan gathers q/k/v and keeps these norms replicated)

    def build(self, module, context):
        if context.is_grid:
            if context.tensor_parallel_mode == "3d":  # the cube's column outputs are split over another axis
                refuse_grid_mode(context, "a full-width (OLMo 2) q/k norm under '3d'")
            # 2D / 2.5D: the projection's output is split over the hidden like the residual stream, so the
            # stream's grid norm (sum of squares all-reduced over the row) is this norm, with OLMo 2's formula.
            weight = module.weight
            return RMSNorm2D(weight.shape[0], module.variance_epsilon, grid=Grid.from_context(context),
                             formula="olmo2", device=weight.device, dtype=weight.dtype)
        replicas = HeadSplit(0, module.num_heads).replicas(context.tp_size)
        replica_group = context.tp_subgroup(replicas) if replicas > 1 else None
        return TensorParallelFullWidthRMSNorm.from_plain(module, context.tp_group, replica_group=replica_group)

    def layouts(self, module):  # 1D; the grid norm states its own (``tp_shard_specs``)
        return {"weight": HeadSplit(0, getattr(module, "full_heads", module.num_heads))}
