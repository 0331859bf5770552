"""``peft`` LoRA on a generic-path model at tensor_parallel_size > 1: the adapters take their base layer's placements.

``peft`` builds each adapter of a tensor-parallel ``nn.Linear`` at the local shard's sizes (``_get_in_out_features``
reads ``weight.to_local().shape``) and computes it with plain tensors: on a colwise base ``A`` is ``[r, in]`` whole and
``B`` ``[out/tp, r]`` local (``A``'s gradient then sums only this rank's output columns: partial); on a rowwise base
``A`` is ``[r, in/tp]`` local and ``B`` ``[out, r]`` whole (``A x`` is a partial sum over tp, never reduced). Here the
adapter modules get the placements of their base, through ``transformers``' own tensor-parallel styles on the LoRA
submodules (their public ``install_forward`` / DTensor parameters, as ``transformers`` treats the base layers; ``peft``
is not edited):

- colwise base (weight ``Shard(0)``): ``lora_A`` stays a plain replicated ``[r, in]``; ``lora_B`` gets
  ``ColwiseParallel``: its weight is a DTensor ``[out, r]`` ``Shard(0)`` (this rank's ``[out/tp, r]`` rows), its input
  ``A x [b, s, r]`` enters as ``Replicate`` and its output leaves as the local ``[b, s, out/tp]``, added to the base's
  local output. Forward: no collective. Backward: the gradient of ``A x`` is ``Partial`` over tp and is all-reduced
  (the DTensor ``from_local`` boundary), so ``A``'s gradient and the input's are whole.
- rowwise base (weight ``Shard(1)``): ``lora_A`` gets ``RowwiseParallel``: its weight is a DTensor ``[r, in]``
  ``Shard(1)`` (this rank's ``[r, in/tp]`` columns), its input the local ``x [b, s, in/tp]`` as ``Shard(-1)``, its
  output ``[b, s, r]`` ``Partial`` then all-reduced to ``Replicate`` (forward all-reduce, backward identity); ``lora_B``
  stays a plain replicated ``[out, r]`` whose gradient is whole on every rank.

Installed when an adapter's tensors are loaded into the model (a ``load_state_dict`` pre-hook of the generic model,
so ``adapters.load_adapter`` and ``peft.PeftModel.from_pretrained`` both get it): the layers are converted, then the
loaded full tensors (``peft``'s single-process ``[r, in]`` / ``[out, r]``) are sliced into DTensors of the same
placements, locally (``distribute_tensor(src_data_rank=None)``: no collective). The adapters then equal single-process
``peft``'s exactly. A fresh ``get_peft_model`` adapter (no load) is left as ``peft`` built it and refused by
``training_refusal`` (its local draws are not ``peft``'s single-process ones). ``adapters.save_adapter`` writes the
full tensors (``adapter_state_dict`` calls ``full_tensor()`` on every DTensor adapter: collective over tp and dp).

Refused here (``NotImplementedError`` at load, before any collective): LoRA options that would not match a single
process (DoRA, ``lora_bias``, ``lora_dropout > 0`` on a rowwise base, whose input is a feature slice), sequence
parallelism. Adapters on modules the plan does not split colwise/rowwise stay unconverted and are refused by
``training_refusal`` (``unconverted_adapters``).
"""
from __future__ import annotations

import torch
from torch import nn

STYLES = ("colwise", "rowwise")
_MARK = "_oslo_lora_tp_style"


def _tuner_layers(model: nn.Module):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def _style_of(name: str, module: nn.Module, plan: dict) -> str | None:
    from peft.tuners.lora.layer import Linear as LoraLinear

    if not isinstance(module, LoraLinear) or not isinstance(module.get_base_layer(), nn.Linear):
        return None
    style = plan.get(name)
    return style if style in STYLES else None


def unconverted_adapters(model: nn.Module) -> list[str]:
    """The tuner layers of ``model`` (tp > 1) whose adapters do not carry their base's placements (``[]``: all do)."""
    return [name for name, module in _tuner_layers(model) if getattr(module, _MARK, None) is None]


def _refuse(name: str, module: nn.Module, style: str, context) -> None:
    if context.config.sequence_parallel:
        raise NotImplementedError(
            f"peft LoRA on a generic-path model at tensor_parallel_size={context.tp_size} with sequence_parallel "
            f"({name}): the plan's layers then run on sequence slices and the adapters' collectives for that are not "
            "implemented; use sequence_parallel=False")
    for adapter in module.lora_A:
        if module.use_dora.get(adapter, False) or module.lora_bias.get(adapter, False):
            raise NotImplementedError(
                f"peft LoRA with DoRA or lora_bias on a tensor-parallel generic-path layer ({name}) is not "
                "implemented; use plain LoRA")
        dropout = module.lora_dropout[adapter]
        if style == "rowwise" and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise NotImplementedError(
                f"lora_dropout={dropout.p} on the rowwise layer {name} at tensor_parallel_size={context.tp_size}: "
                "its input is this rank's feature slice, so peft's dropout mask would not be the single-process "
                "one; use lora_dropout=0 (or tensor_parallel_size=1)")


def _as_dtensor(linear: nn.Linear, placement, full_shape: tuple[int, int], mesh) -> None:
    from torch.distributed.tensor import DTensor

    weight = linear.weight
    if isinstance(weight, DTensor):
        return
    local = weight.detach()
    stride = torch.empty(full_shape, device="meta").stride()
    linear.weight = nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False, shape=full_shape,
                                                    stride=stride), requires_grad=weight.requires_grad)


def _convert(module: nn.Module, style: str, mesh) -> None:
    """Give ``module``'s adapters the placements of its ``style`` base (see the module docstring)."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel

    base = module.get_base_layer()
    for adapter in module.lora_A:
        lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
        if style == "colwise" and not getattr(lora_b, _MARK, None):
            lora_b.out_features = base.out_features
            _as_dtensor(lora_b, Shard(0), (base.out_features, lora_b.in_features), mesh)
            ColwiseParallel().install_forward(lora_b, mesh)
            setattr(lora_b, _MARK, style)
        elif style == "rowwise" and not getattr(lora_a, _MARK, None):
            lora_a.in_features = base.in_features
            _as_dtensor(lora_a, Shard(1), (lora_a.out_features, base.in_features), mesh)
            RowwiseParallel().install_forward(lora_a, mesh)
            setattr(lora_a, _MARK, style)
    setattr(module, _MARK, style)


def convert_adapters(model: nn.Module) -> None:
    """Convert every tuner layer of ``model`` on a colwise/rowwise plan entry not yet converted (local, no
    collective); ``NotImplementedError`` for what is refused (module docstring)."""
    from .install_state import generic_install

    context = model.parallel_context
    plan = generic_install(model).tp_plan or {}
    for name, module in _tuner_layers(model):
        if getattr(module, _MARK, None) is not None:
            continue
        style = _style_of(name, module, plan)
        if style is None:
            continue  # left as peft built it: refused by training_refusal
        _refuse(name, module, style, context)
        _convert(module, style, context.mesh["tp"])


def _load_pre_hook(model, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook of the generic model: convert the adapters, then slice each full adapter tensor
    of ``state_dict`` into a DTensor of its parameter's placements (locally: ``src_data_rank=None``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not any(True for _ in _tuner_layers(model)):
        return
    convert_adapters(model)
    for name, param in model.named_parameters():
        key = prefix + name
        tensor = state_dict.get(key)
        if "lora_" not in name or tensor is None or not isinstance(param, DTensor) or isinstance(tensor, DTensor):
            continue
        if tuple(tensor.shape) == tuple(param.shape):
            state_dict[key] = distribute_tensor(tensor.to(param.dtype), param.device_mesh, param.placements,
                                                src_data_rank=None)


def install(model: nn.Module) -> None:
    """Register the conversion on a generic model split over tp (``loading._attach``)."""
    if model.parallel_context.tp_size > 1:
        model.register_load_state_dict_pre_hook(_load_pre_hook)
