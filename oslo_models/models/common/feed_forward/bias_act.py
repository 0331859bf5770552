"""A linear layer followed by GELU, with the bias add and the activation fused into one kernel (Megatron's
bias-GELU) when ``ParallelConfig.fused_ops`` allows.

The linear (a column-parallel layer, or the plain ``Linear`` it replaces) is called with ``skip_bias_add=True``
and returns ``(x @ W, bias)``, bias unadded (Megatron's ``skip_bias_add``); ``fused_ops.bias_gelu`` then computes
``gelu(y + bias)`` in one pass forward and one backward. Shapes: input ``[b, s, in]`` (``[b, s/tp, in]`` under
sequence parallelism), output ``[b, s, out/tp]``; collectives are the linear's own (none added here).

Which GELU: the one the config names, exactly as ``transformers``' ``ACT2FN`` computes it.
``gelu``/``gelu_python`` are the exact erf form (BERT), ``gelu_new``/``gelu_pytorch_tanh`` the tanh approximation
(GPT-2, T5 v1.1 gated-GELU). Every other activation (``relu``, ``gelu_fast``, ``quick_gelu``, a callable, ...)
runs unfused, as do layers whose ``forward`` does not take ``skip_bias_add`` (the 2D/2.5D/3D grid layers).

The choice is made once, when the model is built (the MLPs' ``configure_fused_ops``, called through
``common/stack/fused_kernels.configure_fused_ops`` by ``finish_init`` after the
plan swapped the layers in); ``forward`` only asks the dispatcher whether the kernel runs on these tensors
(CUDA, or ``OSLO_FUSED_OPS=force`` under the interpreter). When it does not, the unfused path runs unchanged, so
CPU numerics are bit for bit those of ``transformers``.
"""
from __future__ import annotations

import torch
from torch import nn

from .... import fused_ops

# ACT2FN name -> bias_gelu's ``approximate``: only the activations the kernel computes exactly.
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def supports_skip_bias_add(linear: nn.Module) -> bool:
    """Whether ``linear``'s own ``forward`` takes ``skip_bias_add`` (a subclass overriding it may not)."""
    return bool(getattr(type(linear).forward, "takes_skip_bias_add", False))


def fused_gelu_approximation(enabled: bool, hidden_act, linear: nn.Module) -> str | None:
    """``approximate`` for ``bias_gelu`` when the fused path applies to ``act(linear(x))``, else ``None``."""
    if not enabled or not isinstance(hidden_act, str) or not supports_skip_bias_add(linear):
        return None
    return GELU_APPROXIMATIONS.get(hidden_act)


def linear_act(linear: nn.Module, act, x: torch.Tensor, *, approximate: str | None,
               sequence_parallel: bool | None = None) -> torch.Tensor:
    """``act(linear(x))``; with ``approximate`` set and the kernel running on ``x``, ``bias_gelu`` on the
    unbiased output instead (same function, one fused pass)."""
    if approximate is not None and fused_ops.use_triton(x):
        y, bias = linear(x, sequence_parallel=sequence_parallel, skip_bias_add=True)
        return fused_ops.bias_gelu(y, bias, approximate)
    return act(linear(x, sequence_parallel=sequence_parallel))

