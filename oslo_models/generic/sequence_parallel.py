"""Sequence parallelism for generic decoders, built from the type's tensor-parallel plan and module tree.

Megatron's layout: between the tensor-parallel regions each tp rank holds ``1/tp`` of the sequence (norms, residual
adds, dropout run on that slice), and the sequence is gathered once at the entry of each region and reduce-scattered
at its exit. On a ``transformers`` model with a plan:

- the decoder layers are the model's ``layers`` list (its ``base_model_pp_plan`` entry, or the repeated blocks). A
  pre-hook on the first layer cuts the hidden states along the sequence (backward: all-gather of the gradient); a
  post-hook on the last one gathers them back (backward: the rank's slice), so everything outside the layers
  (embeddings, positions, masks, the final norm and head) sees the whole sequence as ``transformers`` wrote it;
- a *region* is a direct child of a layer that holds ``colwise`` entries of the plan (``self_attn``, ``mlp``). A
  pre-hook gathers its ``hidden_states`` once - ``DTensor`` ``Shard(1) -> Replicate``, passed on as a DTensor, so the
  colwise projections inside take it as it is and their input gradients (each ``Partial``) are added up by DTensor
  and reduce-scattered once at the gather (backward) - and its ``rowwise`` projections reduce-scatter their output to
  the sequence slice (``RowwiseParallel(output_layouts=Shard(1))``) instead of all-reducing it;
- an *MoE region* (a region holding a ``moe_tp_experts`` entry or the experts of the type's expert-parallel plan:
  GLM-4.5's, ERNIE 4.5's MoE blocks) keeps its
  exits' all-reduce (the experts and shared experts work on the flattened ``[b * s, h]`` tokens, which cannot be
  reduce-scattered along the sequence); its modules with parameters or buffers of their own that no plan entry names
  (the router) take the gathered sequence as a plain tensor (``to_local``: their gradient is whole on every tp rank,
  which DTensor adds to the colwise projections' partial ones as such), and the region's whole output is cut to the
  rank's slice (``Replicate -> Shard(1)``; backward: an all-gather of the slices' gradients). The router so sees
  every token of the sequence, as in ``transformers``;
- every other child of a layer must be per-token: a module with no parameters, or a norm (a class named ``*Norm*``
  with 1-D parameters). The norm weights then see only the rank's tokens: their gradients are partial over tp, which
  ``partial_gradients.py`` finds in the graph like any other and sums over tp.

Anything else (a mixer or router outside a region, which would see only its rank's tokens, e.g. the state-space
layers of a hybrid or an MoE router) is refused with the reason before the model is split; code inside a layer that
combines a slice with a whole-sequence tensor is refused when the load's dummy forward fails. The sequence length of
a batch must be divisible by tp (``ValueError`` from the first layer's hook, on every rank alike).

Collectives per layer and forward: one all-gather of ``[b, s, h]`` per region and one reduce-scatter per rowwise
exit (an MoE region: its exits' all-reduces, then a local cut; backward: the mirror); once per forward: the cut
(none) and the gather at the last layer.
"""
from __future__ import annotations

from torch import nn

from .install_state import generic_install

_COLWISE = ("colwise", "packed_colwise")
_ROWWISE = ("rowwise", "packed_rowwise")
_MOE_EXPERTS = "moe_tp_experts"


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(prefix, layer)`` of the model's decoder layers: its ``base_model_pp_plan``'s ``layers`` list, or the
    largest list of modules of one class."""
    from ..utils.modules import repeated_blocks

    base = getattr(model, "base_model_prefix", "")
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in (getattr(text, "base_model_pp_plan", None) or {}):
        for prefix in (f"{base}.{key}" if base else key, key):
            try:
                found = model.get_submodule(prefix)
            except AttributeError:
                continue
            if isinstance(found, nn.ModuleList):
                return [(f"{prefix}.{index}", layer) for index, layer in enumerate(found)]
    return repeated_blocks(model)


def _per_token(module: nn.Module) -> bool:
    params = list(module.parameters())
    return not params or ("Norm" in type(module).__name__ and all(p.dim() == 1 for p in params))


def regions(model: nn.Module, plan: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(layer prefixes, region prefixes)``; ``NotImplementedError`` naming what sequence parallelism cannot split.
    Reads only the module tree and the plan (no collective)."""
    layers = decoder_layers(model)
    if not layers:
        raise NotImplementedError(f"sequence_parallel=True: {type(model).__name__} has no list of decoder layers "
                                  "(base_model_pp_plan 'layers' or repeated blocks) to run on sequence slices")
    found = []
    for prefix, layer in layers:
        for child_name, child in layer.named_children():
            name = f"{prefix}.{child_name}"
            styles = {style for key, style in plan.items() if key.startswith(name + ".")}
            if styles & set(_COLWISE):
                if not styles & set(_ROWWISE):
                    raise NotImplementedError(f"sequence_parallel=True: {name} has colwise but no rowwise entries in "
                                              f"the plan (no exit to reduce-scatter to the sequence slice)")
                found.append(name)
            elif not _per_token(child):
                raise NotImplementedError(
                    f"sequence_parallel=True: {name} ({type(child).__name__}) has parameters and no colwise entries in "
                    f"the tensor-parallel plan, so under sequence parallelism it would see only this rank's tokens "
                    f"(a sequence mixer or router outside the plan's regions); use sequence_parallel=False")
    return [prefix for prefix, _ in layers], found


def _expert_modules(model: nn.Module) -> set[str]:
    """Names of the modules the type's ``base_model_ep_plan`` dispatches tokens to (``ep_dispatch_experts``)."""
    import re

    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    base = getattr(model, "base_model_prefix", "")
    patterns = [re.compile(re.escape(f"{base}.{key}" if base else key).replace(r"\*", r"\d+"))
                for key, style in (getattr(text, "base_model_ep_plan", None) or {}).items()
                if style == "ep_dispatch_experts"]
    return {name for name, _ in model.named_modules() if any(p.fullmatch(name) for p in patterns)}


def moe_regions(model: nn.Module, plan: dict[str, str], region_names: list[str]) -> list[str]:
    """The regions that are MoE blocks: holding a ``moe_tp_experts`` entry (experts split over tp) or experts
    module of the type's expert-parallel plan (split over ep instead)."""
    experts = _expert_modules(model)
    return [region for region in region_names
            if any(style == _MOE_EXPERTS and key.startswith(region + ".") for key, style in plan.items())
            or any(name.startswith(region + ".") for name in experts)]


def rowwise_overrides(plan: dict[str, str], region_names: list[str], moe: list[str] = ()) -> dict:
    """The region exits' styles: ``rowwise`` entries inside a region reduce-scatter to the sequence slice (except in
    an MoE region (``moe``), whose flattened ``[b * s, h]`` exits all-reduce and whose whole output is then cut)."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import RowwiseParallel

    exit_style = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1))
    dense = [region for region in region_names if region not in moe]
    return {key: exit_style for key, style in plan.items() if style == "rowwise"
            and any(key.startswith(region + ".") for region in dense)}


def _local_modules(region: nn.Module, prefix: str, plan: dict[str, str]) -> list[nn.Module]:
    """Modules of an MoE region holding parameters or buffers of their own that no plan entry names (the router):
    they take the gathered sequence as a plain tensor."""
    named = set(plan)
    found = []
    for name, module in region.named_modules(prefix=prefix):
        own = [f"{name}.{key}" for key, value in [*module._parameters.items(), *module._buffers.items()]
               if value is not None]
        if own and name not in named and not any(key in named for key in own):
            found.append(module)
    return found


def _to_local(value):
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _replace_hidden(args, kwargs, change):
    if args:
        return (change(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}


def install(model: nn.Module, context, layer_names: list[str], region_names: list[str]) -> None:
    """The hooks of the module docstring (the rowwise exits are applied with the plan)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh, tp = context.mesh["tp"], context.tp_size

    def cut(hidden):
        if hidden.shape[1] % tp:
            raise ValueError(f"sequence_parallel=True needs the sequence length divisible by "
                             f"tensor_parallel_size={tp}; got {hidden.shape[1]}")
        whole = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        return whole.redistribute(placements=[Shard(1)]).to_local()

    def gather(hidden):
        if isinstance(hidden, DTensor):
            return hidden
        return DTensor.from_local(hidden, mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()])

    def gathered_output(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        whole = DTensor.from_local(first, mesh, [Shard(1)], run_check=False)
        whole = whole.redistribute(placements=[Replicate()]).to_local()
        return (whole, *output[1:]) if isinstance(output, tuple) else whole

    def cut_output(module, args, output):
        whole = output if isinstance(output, DTensor) else DTensor.from_local(output, mesh, [Replicate()],
                                                                               run_check=False)
        return whole.redistribute(placements=[Shard(1)]).to_local()

    def local_inputs(module, args, kwargs):
        return tuple(_to_local(a) for a in args), {key: _to_local(v) for key, v in kwargs.items()}

    # under pipeline parallelism (``pipeline_cut.py``) a rank holds some layers only (the others are parameter-free
    # probes): the first stage cuts at the model's first layer, the last gathers after its last, and the stages
    # exchange the slices ``[mb, s/tp, h]`` in between (``pipeline_stage.py``)
    held = [name for name in layer_names if not _is_probe(model.get_submodule(name))]
    if layer_names[0] in held:
        model.get_submodule(layer_names[0]).register_forward_pre_hook(
            lambda module, args, kwargs: _replace_hidden(args, kwargs, cut), with_kwargs=True)
    if layer_names[-1] in held:
        model.get_submodule(layer_names[-1]).register_forward_hook(gathered_output)
    plan = generic_install(model).tp_plan or {}
    moe = moe_regions(model, plan, region_names)
    for name in region_names:
        if not any(name.startswith(layer + ".") for layer in held):
            continue  # a region of a layer another pipeline rank holds
        region = model.get_submodule(name)
        region.register_forward_pre_hook(
            lambda module, args, kwargs: _replace_hidden(args, kwargs, gather), with_kwargs=True)
        if name in moe:  # whole output (the experts' all-reduce): cut to the slice (backward: all-gather)
            region.register_forward_hook(cut_output)
            for module in _local_modules(region, name, plan):  # the router sees the gathered tokens, whole
                module.register_forward_pre_hook(local_inputs, with_kwargs=True)


def _is_probe(module: nn.Module) -> bool:
    from .pipeline_cut import LayerProbe

    return isinstance(module, LayerProbe)


def apply_plan(model: nn.Module, mesh, plan: dict[str, str], overrides: dict) -> None:
    """``transformers``' ``apply_tensor_parallelism`` with some entries given as style objects (``overrides``)."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    modules, parameters = dict(model.named_modules()), dict(model.named_parameters())
    for name, style_name in plan.items():
        style = overrides.get(name) or ALL_PARALLEL_STYLES[style_name]
        if name in parameters:
            module_name, _, param_name = name.rpartition(".")
            module = modules[module_name]
            style.validate_param(module, param_name, mesh, parameter_name=name)
            style.shard_param(module, param_name, mesh)
        else:
            module = modules[name]
            if style_name == "mla_kv_a_proj":
                module.config = model.config.get_text_config()
            style.install_forward(module, mesh)
        module._is_hooked = True

