"""Fused kernels chosen once, when a native model is built, from ``ParallelConfig.fused_ops``: no ``fused=``
argument is threaded through the constructors of blocks and components.

A component that can run a fused Triton kernel (an RMS norm, an attention's rotary, a GELU MLP's bias-GELU) has a
``configure_fused_ops(enabled)`` method; ``OsloPreTrainedModel.finish_init`` calls :func:`configure_fused_ops` on
the whole model after the parallel plan swapped its layers in, so each component picks its kernels once, on the
layers it will run. Components that only switch a ``fused`` flag take the :class:`FusedKernels` mixin. ``forward``
then only asks the dispatcher whether the kernel runs on its tensors (CUDA, or ``OSLO_FUSED_OPS=force`` under the
Triton interpreter); when it does not, the unfused path runs, bit for bit ``transformers``' numerics. No collective.
"""
from __future__ import annotations

from torch import nn


class FusedKernels:
    """Mixin of a component with a fused kernel behind one switch: ``fused`` is ``False`` when built and set by
    :func:`configure_fused_ops` (``ParallelConfig.fused_ops``)."""

    fused: bool = False

    def configure_fused_ops(self, enabled: bool) -> None:
        self.fused = enabled


def configure_fused_ops(model: nn.Module, enabled: bool) -> None:
    """Let every submodule with a ``configure_fused_ops(enabled)`` method pick its fused paths, once the parallel
    layers are in place (``OsloPreTrainedModel.finish_init``)."""
    for module in model.modules():
        configure = getattr(module, "configure_fused_ops", None)
        if module is not model and callable(configure):
            configure(enabled)
