"""Outputs of tensor-parallel modules that the model's code modifies in place, copied when autograd records.

``transformers``' tensor-parallel styles return their output as ``DTensor.to_local()``: a view made inside a custom
autograd Function, which autograd forbids modifying in place while it records ("Output 0 of _ToTorchTensor is a view
and is being modified inplace"). Inference never notices (the styles' no-grad fast path returns plain tensors), but
training does: Llama 4 adds its routed experts into the shared expert's rowwise output with ``out.add_(...)``, OLMo /
OLMoE clip q / k / v with ``clamp_`` when ``clip_qkv`` is set.

:func:`find_modified_outputs` runs one no-grad forward of the dummy inputs with a forward hook on every module the
plan names, noting each output's version counter (which every in-place write to it or to a view of it bumps) when
the module returns; the modules whose output's counter moved afterwards are the ones. :func:`copy_outputs` gives
each of them a forward hook returning a copy of the output while grad is enabled (one copy of that activation per
forward; the view it replaces is not kept for the backward). No collective beyond the forward's own.
"""
from __future__ import annotations

import torch
from torch import nn

from .dummy_forward import dummy_forward, refused_on_error


def find_modified_outputs(model: nn.Module, context, plan: dict[str, str]) -> tuple[str, ...]:
    """Names of the modules in ``plan`` whose output the model's own code later modifies in place."""
    modules = dict(model.named_modules())
    seen: list[tuple[str, torch.Tensor, int]] = []

    def note(name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                seen.append((name, output, output._version))
        return hook

    handles = [modules[name].register_forward_hook(note(name)) for name in plan if name in modules]
    try:
        with refused_on_error(model, context):
            dummy_forward(model, context, grad=False)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(sorted({name for name, output, version in seen if output._version != version}))


def _copy_output(module, args, output):
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor):
        return output.clone()
    return output


def copy_outputs(model: nn.Module, names) -> None:
    for name in names:
        model.get_submodule(name).register_forward_hook(_copy_output)
