"""``om.capabilities(model_or_type)``: which parallel axes and training features apply to a model, and why not the rest.

    >>> print(om.capabilities("mamba"))
    mamba: generic path (transformers' own classes)
      data_parallel          yes  DDP over the dp axis
      tensor_parallel        no   tensor_parallel_size=2: 'mamba' has no native family ... runs data parallel only
      ...
    >>> om.capabilities(model).supports("zero_3")
    True

The answers come from the checks that guard ``from_pretrained``, not from a table: each axis is asked for on its
own (a ``ParallelConfig`` with just that axis at 2, or the mode in question) and the validation of the path that
would build the model - a native family's ``validate_parallel_config`` and context-parallel check, or the generic
path's ``support.refusals`` - either accepts it or says why not. Sizes are judged on the model's own config, or,
for a bare model type, on the family's tiny test config (native) or ``transformers``' default config (generic).
"""
from __future__ import annotations

from dataclasses import dataclass

# feature name -> the ParallelConfig that asks for it (None: needs nothing from the model's layers)
_REQUESTS = {
    "data_parallel": None, "zero_1": None, "zero_2": None, "zero_3": None, "cpu_offload": None,
    "mixed_precision": None, "resumable_checkpoints": None, "save_pretrained": None,
    "tensor_parallel": dict(tensor_parallel_size=2),
    "sequence_parallel": dict(tensor_parallel_size=2, sequence_parallel=True),
    "tensor_parallel_grid": dict(tensor_parallel_size=4, tensor_parallel_mode="2d"),
    "pipeline_parallel": dict(pipeline_parallel_size=2, num_microbatches=2),
    "context_parallel": dict(context_parallel_size=2),
    "expert_parallel": dict(expert_parallel_size=2),
    "activation_checkpointing": dict(activation_checkpointing="full"),
    "selective_checkpointing": dict(activation_checkpointing="selective"),
}
_ALWAYS = {
    "data_parallel": "DDP over the dp axis of the mesh", "zero_1": "optimizer state sharded over dp",
    "zero_2": "FSDP2 on the dp axis, gradients sharded", "zero_3": "FSDP2 on the dp axis, parameters sharded",
    "cpu_offload": "FSDP2 CPU offload (zero_stage 2/3)", "mixed_precision": "Accelerate's bf16/fp16 autocast",
    "resumable_checkpoints": "save_checkpoint / load_checkpoint (DCP), resumable at another tp/dp/ZeRO layout",
    "save_pretrained": "a plain Hub folder (save_pretrained / push_to_hub)",
}


@dataclass(frozen=True)
class Feature:
    name: str
    supported: bool
    why: str  # how it applies, or the refusal the model would get


@dataclass(frozen=True)
class Capabilities:
    """What one model type (or model) supports: ``path`` is ``"native"`` (a family of this project) or
    ``"generic"`` (``transformers``' own class); ``features`` in a fixed order."""

    model_type: str
    path: str
    features: tuple[Feature, ...]

    def __getitem__(self, name: str) -> Feature:
        for feature in self.features:
            if feature.name == name:
                return feature
        raise KeyError(f"unknown feature {name!r}; features are {[f.name for f in self.features]}")

    def supports(self, name: str) -> bool:
        return self[name].supported

    @property
    def supported(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features if f.supported)

    def as_dict(self) -> dict:
        return {"model_type": self.model_type, "path": self.path,
                "features": {f.name: {"supported": f.supported, "why": f.why} for f in self.features}}

    def __str__(self) -> str:
        where = "native family" if self.path == "native" else "generic path (transformers' own classes)"
        width = max(len(f.name) for f in self.features)
        lines = [f"{self.model_type}: {where}"]
        lines += [f"  {f.name:<{width}}  {'yes' if f.supported else 'no ':<3}  {f.why}" for f in self.features]
        return "\n".join(lines)


def _native_refusal(model_class, config, parallel) -> str | None:
    from ..models.common.stack.context_parallel import check_context_parallel

    try:
        model_class.validate_parallel_config(config, parallel)
        check_context_parallel(model_class, config, parallel)
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return None


def _native(model_type: str, config, model_class) -> Capabilities:
    from ..config import ParallelConfig
    from ..models import registry

    record = registry.family_record(model_type)
    if model_class is None:
        model_class = record.model_class(record.main_task())
    if config is None:
        config = record.config_class()(**record.tiny_config)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    features = []
    for name, request in _REQUESTS.items():
        if request is None:
            features.append(Feature(name, True, _ALWAYS[name]))
            continue
        try:
            why = _native_refusal(model_class, config, ParallelConfig(**request))
        except (ValueError, NotImplementedError) as error:  # the ParallelConfig itself refuses the combination
            why = str(error)
        if name == "pipeline_parallel" and why is None and getattr(model_class, "pipeline_adapter", None) is None:
            why = f"{model_class.__name__} has no pipeline stages"
        if name == "expert_parallel" and why is None and not experts:
            why = f"{model_type!r} has no mixture-of-experts layers: there are no experts to split"
        features.append(Feature(name, why is None, why or f"{model_class.__name__}: native layers"))
    features.append(Feature("fused_ops", True, "Triton kernels on CUDA (torch reference elsewhere)"))
    return Capabilities(model_type, "native", tuple(features))


def _generic(model_type: str, config, model_class) -> Capabilities:
    from ..config import ParallelConfig
    from . import support

    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.for_model(model_type)
    plan = support.tensor_parallel_plan(config, model_class)
    features = []
    for name, request in _REQUESTS.items():
        if request is None:
            features.append(Feature(name, True, _ALWAYS[name]))
            continue
        reasons = support.refusals(config, ParallelConfig(**request), model_class)
        how = {"tensor_parallel": f"transformers' base_model_tp_plan ({len(plan)} entries) as DTensors on the tp "
                                  f"axis", "activation_checkpointing": "transformers' gradient_checkpointing_enable",
               "sequence_parallel": "layers on sequence slices around the plan's regions (each layer checked at "
                                    "load: generic/sequence_parallel.py)",
               "context_parallel": "ring / all-to-all through transformers' attention interface (every layer "
                                   "checked at load: generic/context_parallel.py; an MoE's load-balancing loss "
                                   "over the replica's tokens: generic/router_loss.py)",
               "expert_parallel": "transformers' base_model_ep_plan over the ep part of dp x cp, with tp / SP, cp "
                                  "and ZeRO 0-3 (the experts leave the tp plan; every tp rank routes its "
                                  "replica's batch)",
               "pipeline_parallel": "decoder layers cut into stages (base_model_pp_plan, or the _no_split_modules "
                                    "blocks), every schedule, with dp, ZeRO 0-3, tp (+ SP), cp and ep (the module "
                                    "tree checked at load: generic/pipeline_cut.py)"}
        features.append(Feature(name, not reasons, "; ".join(reasons) or how.get(name, "generic path")))
    features.append(Feature("fused_ops", False, "transformers' own modules run as they are (no fused kernels)"))
    return Capabilities(model_type, "generic", tuple(features))


def capabilities(model_or_type, task: str | None = None) -> Capabilities:
    """What ``model_or_type`` supports: a model (native or generic, possibly inside DDP), a config, or a model type
    string. ``task`` (e.g. ``"causal_lm"``) picks the class when a type has a native family for some tasks only."""
    from ..models import registry
    from ..utils.modules import unwrap_model
    from . import is_generic, support

    model_class = config = None
    if isinstance(model_or_type, str):
        model_type = model_or_type
    elif hasattr(model_or_type, "model_type") and not hasattr(model_or_type, "config"):
        config, model_type = model_or_type, model_or_type.model_type
    else:
        model = unwrap_model(model_or_type)
        model_class, config, model_type = type(model), model.config, model.config.model_type
        if is_generic(model):
            return _generic(model_type, config, model_class)
        return _native(model_type, config, model_class)
    native = {record.model_type: record for record in registry.families()}.get(model_type)
    if native is not None and (task is None or task in native.classes):
        return _native(model_type, config, native.model_class(task) if task else None)
    if task is not None:
        from transformers import AutoConfig

        model_class = support.transformers_class(task, config or AutoConfig.for_model(model_type))
    return _generic(model_type, config, model_class)
