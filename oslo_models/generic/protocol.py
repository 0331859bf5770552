"""The generic path's answers to the model protocol (``utils/model_protocol.py``) for ``transformers``' own classes.

- ``layout = "placements"``: parameters split by the type's tensor-parallel plan (and FSDP2) are DTensors whose
  placements say where each element lives; the rest are whole on every rank.
- FSDP2 units: the outermost modules named by the model's ``_no_split_modules`` (a type may name a block and a module
  inside it, e.g. Mamba's ``MambaBlock`` and ``MambaMixer``; FSDP2 wants one unit per parameter), falling back to the
  repeated blocks (the items of the model's largest ``nn.ModuleList`` of one class) when it names none. Blocks
  holding a tied weight stay in the root unit, as for native models.
- experts: the modules holding parameters split over ``ep`` by ``transformers``' expert-parallel plan, sharded by
  FSDP2 over the ``edp`` dimension of the mesh they were split on (``expert_parallel.py``).
- pipeline stages: cut from the decoder's layer list (``pipeline_cut.py``, ``pipeline_stage.py``);
- per-block ZeRO plans are refused: ``transformers`` builds its blocks without the plan's checkpoint flags.
"""
from __future__ import annotations

from torch import nn

from ..utils.model_protocol import ModelProtocol
from ..utils.modules import outermost, repeated_blocks, shares_parameters_outside
from .install_state import generic_install


class GenericProtocol(ModelProtocol):
    layout = "placements"
    block_plan_refusal = ("a block_plan on a transformers model (the generic path) is not implemented: its blocks "
                          "are not built with the plan's checkpoint flags; use a native oslo_models family")

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        names = set(getattr(model, "_no_split_modules", None) or ())
        found = [(prefix, module) for prefix, module in model.named_modules()
                 if module is not model and type(module).__name__ in names]
        units = outermost(found) or repeated_blocks(model)
        return [module for prefix, module in units if not shares_parameters_outside(prefix, module, model)]

    def check_layout(self, model: nn.Module, parallel) -> None:
        from .support import check_parallel

        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the model's own class
        if hasattr(model, "get_base_model"):  # a peft wrapper: the model it adapts
            model = model.get_base_model()
        check_parallel(model.config, parallel, type(model))

    def training_refusal(self, model: nn.Module) -> str | None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        context = model.parallel_context
        if context.tp_size > 1 and any(isinstance(m, BaseTunerLayer) for m in model.modules()):
            refusal = _lora_tensor_parallel_refusal(model)
            if refusal:
                return refusal
        on_experts = _adapted_experts(model, BaseTunerLayer)
        if on_experts:
            return lora_experts_refusal(model.parallel_context.ep_size, on_experts[0])
        return None

    def pipeline_adapter(self, model: nn.Module):
        from .pipeline_stage import GenericCausalLMPipelineAdapter

        adapter = generic_install(model).pipeline_adapter  # set when the model was cut (pipeline_stage.cut)
        return adapter if adapter is not None else GenericCausalLMPipelineAdapter.for_model(model)

    def expert_units(self, model: nn.Module) -> list[nn.Module]:
        from .expert_parallel import expert_units

        return expert_units(model)

    def divide_expert_gradients(self, unit: nn.Module, expert_data_parallel_size: int, dp_size: int) -> None:
        from .expert_parallel import GradientScale

        unit.register_forward_pre_hook(GradientScale(expert_data_parallel_size / dp_size))

    def expert_data_parallel_mesh(self, model: nn.Module, context):
        return generic_install(model).expert_mesh["edp"]  # the mesh its experts were split on (expert_parallel.py)


def _lora_tensor_parallel_refusal(model: nn.Module) -> str | None:
    """Why these peft adapters on a generic model at tp > 1 are refused, or ``None``: LoRA loaded from an adapter
    folder on the plan's colwise/rowwise layers (``lora_tensor_parallel.py``) at tp x dp (ZeRO 0-3) is exact."""
    from .lora_tensor_parallel import unconverted_adapters

    context = model.parallel_context
    unconverted = unconverted_adapters(model)
    if unconverted:
        return lora_tensor_parallel_refusal(type(model).__name__, context.tp_size, unconverted[0])
    if context.pp_size > 1 or context.cp_size > 1:
        return (f"peft adapters on a generic-path {type(model).__name__} at tensor_parallel_size={context.tp_size} "
                f"with pipeline_parallel_size={context.pp_size} / context_parallel_size={context.cp_size}: not "
                "tested (LoRA at tp is checked at tp x dp, ZeRO 0 and 3); use tp x dp, or pp / cp with tp 1")
    return None


def lora_tensor_parallel_refusal(class_name: str, tp_size: int, where: str = "") -> str:
    """Why peft adapters not converted to their base's placements (``lora_tensor_parallel.py``) on a generic model
    at tp > 1 are refused (``training_refusal``; the composition table)."""
    where = f" ({where})" if where else ""
    return (f"peft adapters on a generic-path {class_name} at tensor_parallel_size={tp_size}{where} that were not "
            "loaded from an adapter folder, or that adapt a module the tensor-parallel plan does not split colwise / "
            "rowwise: peft builds each rank's adapter on the local shard of the split layer (its own random A/B per "
            "rank, a row-split adapter's output never summed over tp), so it would not train the adapter a single "
            "process trains. Save the adapter peft makes on the single-process model (or any trained one) and load it "
            "with oslo_models.adapters.load_adapter (or peft.PeftModel.from_pretrained) on the parallel model: the "
            "adapters of the plan's colwise/rowwise layers then take their base's placements and train exactly; or "
            "use tp 1 with data parallelism / ZeRO, or a native oslo_models family")


def lora_experts_refusal(ep_size: int, what: str) -> str:
    """Why peft adapters on the experts split over ep are refused (``training_refusal``; the composition table)."""
    return (f"peft adapters on the experts split over expert_parallel_size={ep_size} ({what}): peft's LoRA of fused "
            "expert parameters adds a whole-size update for every expert to this rank's DTensor slice of the experts "
            "(a plain tensor mixed with a DTensor: the forward fails inside the schedule or the step); target the "
            "attention, dense MLP or shared-expert modules only (tested at pp x ep), or use expert_parallel_size=1")


def _adapted_experts(model: nn.Module, tuner_layer: type) -> list[str]:
    """What of the experts split over ep peft adapts: the adapters' ``target_parameters`` (how peft adapts fused
    experts) naming a parameter of the type's ``base_model_ep_plan`` - read from the adapter configs, the same on every
    rank, also on a pipeline stage holding no experts - and the tuner layers whose adapted module holds DTensor
    parameters split over ep."""
    from torch.distributed.tensor import DTensor

    if model.parallel_context.ep_size == 1:
        return []
    plan = getattr(model.config.get_text_config(), "base_model_ep_plan", None) or {}
    leaves = {key.rpartition(".")[2] for key in plan}
    targets = set()
    for config in (getattr(model, "peft_config", None) or {}).values():
        targets |= set(getattr(config, "target_parameters", None) or ())
    found = sorted(f"target_parameters {name!r}" for name in targets if name.rpartition(".")[2] in leaves)
    for name, module in model.named_modules():
        if isinstance(module, tuner_layer) and any(isinstance(p, DTensor)
                                                   for p in module.get_base_layer().parameters()):
            found.append(name)
    return found
