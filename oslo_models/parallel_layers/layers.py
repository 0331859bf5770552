"""Plain (single-device) layers the model files are written with.

They behave exactly like their ``torch``/``transformers`` twins and keep the same parameter names and layouts.
Two small additions let a parallel plan swap them for the tensor-parallel layers in ``tensor_parallel.py``
without the model code changing:

- ``forward(x, *, sequence_parallel=None)``: accepted and ignored. The parallel replacement gathers /
  reduce-scatters along the sequence when the forward is sequence-parallel (the model's
  ``SequenceParallelRegion``, see ``sequence_parallel.py``, or an explicit ``True``).
- ``Dropout.rng_context()``: the RNG stream dropout inside this module draws from (the default one here).

Layouts: activations ``[batch, seq, hidden]``; ``Linear(layout="linear")`` stores ``weight`` as ``[out, in]``
(``nn.Linear``), ``layout="conv1d"`` as ``[in, out]`` (GPT-2's ``Conv1D``).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

LAYOUTS = ("linear", "conv1d")


def autocast_operands(*tensors: torch.Tensor | None) -> tuple:
    """``tensors`` cast to the autocast dtype of their device when autocast is on there (what autocast does to a
    matmul's operands), else unchanged. For the grid layers' own autograd Functions: autocast reaches their forward
    but not their backward, so an fp32 weight saved in the forward would meet a low-precision gradient there; cast
    outside the Function, the cast's own backward returns the weight's gradient in fp32."""
    first = next(t for t in tensors if t is not None)
    device = first.device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None or not t.is_floating_point() else t.to(dtype) for t in tensors)


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    """``x @ W (+ b)`` for either weight layout; conv1d uses ``addmm`` exactly as ``transformers``' Conv1D."""
    if layout == "linear":
        return F.linear(x, weight, bias)
    out_shape = x.shape[:-1] + (weight.shape[1],)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return out.view(out_shape)


class Linear(nn.Linear):
    """``y = x W^T + b`` with the weight stored in ``layout`` (see module docstring).

    An ``nn.Linear`` for ``isinstance`` checks (``transformers``' ``get_output_embeddings`` contract, tools that
    look for linear layers); with ``layout="conv1d"`` the weight is stored transposed, as GPT-2's ``Conv1D``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, layout: str = "linear",
                 device=None, dtype=None):
        nn.Module.__init__(self)  # not nn.Linear.__init__: the weight's shape depends on the layout
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        shape = (out_features, in_features) if layout == "linear" else (in_features, out_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init (models overwrite it with their own init or a checkpoint)."""
        if self.weight.is_meta:
            return
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None, skip_bias_add: bool = False):
        """``y``, or ``(x W^T, bias)`` with the bias left for the caller to fuse (``skip_bias_add=True``)."""
        if skip_bias_add:
            return linear_forward(x, self.weight, None, self.layout), self.bias
        return linear_forward(x, self.weight, self.bias, self.layout)

    forward.takes_skip_bias_add = True  # see models/common/feed_forward/bias_act.py

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, layout={self.layout}"


class Embedding(nn.Embedding):
    """``nn.Embedding``: ``[batch, seq]`` ids -> ``[batch, seq, dim]``."""

    def forward(self, ids: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        return super().forward(ids)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dim."""

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        return super().forward(x)


class Dropout(nn.Dropout):
    """``nn.Dropout`` drawing from torch's default generator."""

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        return super().forward(x)

    def rng_context(self, sequence_parallel: bool = False):
        return contextlib.nullcontext()
