"""``LayerNorm`` as a block component: the plain layer (``parallel_layers.layers.LayerNorm``) with its plan fragment,
a sequence-parallel-aware norm (replicated weight and bias, gradients summed over TP when each rank normalized
only its slice of the tokens); the per-head layer norm's style (``HeadLayerNormStyle``: Phi's q/k layer norms over
``head_dim``, always summed over TP); and OLMo's parameter-free layer norm."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ....parallel_layers import layers
from ....parallel_layers.plan import SequenceParallelNorm, Style, refuse_grid_mode
from ....parallel_layers.tensor_parallel import SequenceParallelLayerNorm


class LayerNorm(layers.LayerNorm):
    tp_plan = {"": SequenceParallelNorm()}


@dataclass(frozen=True)
class HeadLayerNormStyle(Style):
    """Plan style of a layer norm over ``head_dim`` inside the attention (Phi's ``q_layernorm``/``k_layernorm`` on
    ``[b, n/tp, s, d]``): replicated weight and bias; each tensor-parallel rank normalizes only its own heads, so
    their gradients are always all-reduced over TP (backward; no forward collective). Under the grid modes every
    grid rank normalizes other tokens or heads with the whole ``head_dim``: the same, over the whole TP group."""

    hf_style = "replicated_with_grad_allreduce"

    def build(self, module, context):
        norm = SequenceParallelLayerNorm.from_plain(module, context.tp_group, fused=context.config.fused_ops,
                                                    always_reduce=True)
        if context.is_grid:
            norm.grid_planned = True  # laid out for the grid (see grid_boundary.check_fully_planned)
        return norm


@dataclass(frozen=True)
class StreamOnlyStyle(Style):
    """Plan style of a parameter-free op on the residual stream: nothing to split or reduce under 1D (each rank
    normalizes whole hidden vectors, of all tokens or of its sequence slice); refused under the grid modes, which
    split the hidden a statistic over it would need. Not published (``hf_style`` ``None``)."""

    what: str = "a parameter-free norm over the hidden"
    hf_style = None

    def build(self, module, context):
        refuse_grid_mode(context, self.what)
        return module


class ParameterFreeLayerNorm(nn.Module):
    """``transformers``' ``OlmoLayerNorm``: layer norm over the last dim with no weight and no bias, computed in fp32
    and rounded to the input's dtype (``eps`` 1e-5 as there). Input/output ``[b, s, h]`` (``[b, s/tp, h]`` under
    sequence parallelism). No parameters, so no collective in either direction."""

    tp_plan = {"": StreamOnlyStyle()}

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        return F.layer_norm(x.to(torch.float32), self.normalized_shape, None, None, eps=self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, no weight or bias"
