"""Build and load a model type with no family record as ``transformers``' own class, each rank holding its shard.

    model = om.AutoModelForCausalLM.from_pretrained("path/to/any-causal-lm", parallel=om.ParallelConfig(...))
    type(model)                # transformers' class (e.g. transformers.GraniteForCausalLM)
    model.parallel_context     # the om.ParallelContext, as on a native model

Loading follows ``transformers``' own ``from_pretrained`` step by step, with one step inserted (``_load``):

1. resolve the checkpoint files and the dtype, and build the model on the meta device (``get_init_context``);
2. with ``tensor_parallel_size > 1``, apply the model's ``base_model_tp_plan`` (plus its head's ``_tp_plan``)
   with ``transformers.distributed.tensor_parallel.apply_tensor_parallelism`` on the ``tp`` axis of the model's
   ``ParallelContext.mesh`` - the same DeviceMesh whose ``dp`` axis data parallelism and ZeRO use, so FSDP2 can shard
   the tensor-parallel DTensors again over dp (2D). The parameters become meta DTensors (``Shard``/``Replicate``
   placements over tp; nothing allocated);
3. ``transformers``' loader fills the model: for a DTensor parameter it reads only this rank's slice of the
   checkpoint tensor (``DtensorShardOperation`` on safetensors slices), renaming and converting keys as it always
   does (e.g. per-expert checkpoint weights into fused expert tensors); then missing keys and non-persistent
   buffers (rotary frequencies) are initialized and tied weights tied, as in ``transformers``;
4. with tp, every tensor is copied out of the memory-mapped checkpoint (``_own_storage``), so no slice stays a view
   into the whole tensor and the file is unmapped.

So each rank materializes only its shard: with tp, the split tensors at ``1/tp`` of their size and the rest (norms,
replicated weights) whole; with data parallelism only, the whole model (its replica; as in ``transformers``, its
tensors stay zero-copy views of the mapped checkpoint until written).

Steps 1-3 use ``transformers``' loading internals (``_get_resolved_checkpoint_files``, ``_get_dtype``,
``LoadStateDictConfig``, ``_resolve_parallel_plans``, ``PreTrainedModel._load_pretrained_model`` /
``_finalize_model_loading``), exactly as its
``from_pretrained`` calls them in 5.24: its public ``from_pretrained(distributed_config=...)`` builds a mesh of its
own and applies its own FSDP at load, while the training helpers need the tensor-parallel DTensors on the
``ParallelContext``'s mesh and no data-parallel wrapping yet. Collectives: none beyond the context's (the slices
are computed from the DTensor placements locally); a file error on some ranks is raised on all of them.
"""
from __future__ import annotations

import copy
import os

import torch

from . import (
    context_parallel,
    expert_parallel,
    inplace_outputs,
    lora_tensor_parallel,
    packed_attention,
    partial_gradients,
    pipeline_stage,
    sequence_parallel,
    support,
    token_loss,
    vocab_embedding,
    vocab_parallel_loss,
)
from .install_state import generic_install, update_generic_install
from .protocol import GenericProtocol


def _parallel_config(parallel):
    from ..config import ParallelConfig
    from ..distributed.context import ParallelContext

    if isinstance(parallel, ParallelContext):
        return parallel.config
    if parallel is not None and not isinstance(parallel, ParallelConfig):
        raise ValueError(f"parallel= must be a ParallelConfig or a ParallelContext, got {type(parallel).__name__}")
    return parallel or ParallelConfig()


def _resolve_context(parallel):
    from ..distributed.context import ParallelContext

    if isinstance(parallel, ParallelContext):
        return parallel
    return ParallelContext.from_config(_parallel_config(parallel))


def _resolve_dtype(dtype):
    """This project's convention, as for the native models: ``None`` is fp32 (``transformers`` would read the
    checkpoint's); ``"auto"``, a dtype or its name as in ``transformers``."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"Unknown dtype {dtype!r}")
        return getattr(torch, dtype)
    return dtype


def resolved_tp_plan(model, context) -> dict[str, str]:
    """The model's plan with every ``*`` replaced by layer numbers, as ``transformers`` resolves it for tp."""
    from transformers.distributed.configuration_utils import DistributedConfig

    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=context.tp_size))
    # experts split over ep keep no tp entries (transformers' rule: EP rules take precedence)
    return expert_parallel.without_experts(tp_plan, expert_parallel.expert_plan(model, context))


def _apply_tensor_parallel(model, context) -> dict[str, str]:
    if context.tp_size == 1:
        return {}
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = vocab_parallel_loss.split_head(model, resolved_tp_plan(model, context))  # logits left split by vocab
    # replicated_with_grad_allreduce entries only hook gradients: partial_gradients.py finds those parameters (and
    # the ones no entry names) and sums their gradients itself, once per backward
    applied = {name: style for name, style in plan.items() if style != "replicated_with_grad_allreduce"}
    # a tied copy (a materialized model's lm_head.weight is its embedding's) is split by its owner's entry
    known = {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
    applied = {name: style for name, style in applied.items() if name in known}
    if context.config.sequence_parallel:  # the layers run on sequence slices; regions gather once, exits scatter
        layers, regions = sequence_parallel.regions(model, plan)  # NotImplementedError with the reason
        update_generic_install(model, sequence_parallel=(layers, regions))
        moe = sequence_parallel.moe_regions(model, plan, regions)
        sequence_parallel.apply_plan(model, context.mesh["tp"], applied,
                                     sequence_parallel.rowwise_overrides(applied, regions, moe))
    else:
        apply_tensor_parallelism(model, context.mesh["tp"], applied)
    return plan


def _attach(model, context, plan: dict[str, str]):
    """Mark ``model`` as a generic model of ``context`` (what the training helpers read)."""
    model.parallel_context = context
    model.oslo_protocol = GenericProtocol()  # how training/ asks it for units, layouts, ... (utils/model_protocol.py)
    update_generic_install(model, tp_plan=dict(plan))  # the resolved plan; its presence marks the generic path
    # a causal LM's loss from its logits' vocabulary slices (the head applied colwise); whole logits without labels
    update_generic_install(model, vocab_parallel_loss=bool(plan) and vocab_parallel_loss.install(model, context, plan))
    token_loss.install(model)  # num_items_in_batch honoured, also by models that average their loss themselves
    packed_attention.install(model)  # packed documents attend within themselves (transformers' mask may not)
    lora_tensor_parallel.install(model)  # peft adapters loaded at tp take their base layers' placements
    if generic_install(model).sequence_parallel:
        sequence_parallel.install(model, context, *generic_install(model).sequence_parallel)
    if context.cp_size > 1:  # chunks attend across the cp group through transformers' attention interface (its
        context_parallel.install(model, context)  # hook after packed_attention's: that one sees the batch's own)
    if plan:  # what transformers' inference plans miss in training (a dummy forward each, same on every tp rank)
        # outputs of plan modules the model modifies in place: copied while autograd records
        copies = inplace_outputs.find_modified_outputs(model, context, plan)
        inplace_outputs.copy_outputs(model, update_generic_install(model, tp_output_copies=copies).tp_output_copies)
        # replicated parameters fed by tp slices: their gradients summed over tp in the backward
        update_generic_install(model, tp_partial_gradients=partial_gradients.reduce_partial_gradients(model, context))
        # a vocabulary-split embedding keeps its rows' gradient only (DTensor's backward gives the whole [V, h])
        update_generic_install(model, vocab_slice_gradients=vocab_embedding.keep_slice_gradients(model))
    if context.pp_size > 1:  # train_step / eval_step run the schedule; a plain forward is refused
        pipeline_stage.attach(model)
    if context.config.activation_checkpointing == "full":
        # transformers >= 5.23 names it activation_checkpointing_enable (the old name warns); 5.17 has the old only
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _load(model_class, path, config, context, dtype, download_kwargs):
    """Steps 1-4 of the module docstring: meta model, tensor-parallel DTensors, this rank's slices, own storage."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig, _get_dtype, _get_resolved_checkpoint_files
    from transformers.utils.generic import ContextManagers

    files, sharded_metadata = _get_resolved_checkpoint_files(
        path, variant=None, gguf_file=None, use_safetensors=None, user_agent=None,
        is_remote_code=model_class.is_remote_code(),
        transformers_explicit_filename=getattr(config, "transformers_weights", None), download_kwargs=download_kwargs)
    config, dtype = _get_dtype(dtype, files, config, sharded_metadata, None, True, None)
    config.name_or_path = str(path)
    with ContextManagers(model_class.get_init_context(dtype, False, False, False)):
        model = model_class(copy.deepcopy(config))
    dtype_plan = model._get_dtype_plan(dtype)
    conversions = get_model_conversion_mapping(model, None, None)
    plan = _apply_tensor_parallel(model, context)
    experts = expert_parallel.apply(model, context) if context.ep_size > 1 else {}  # whole experts per ep rank
    if context.pp_size > 1:  # this rank's stages only, before anything is read (pipeline_cut.py)
        pipeline_stage.cut(model, context, loaded=False)
    mesh = context.mesh["tp"] if plan else generic_install(model).expert_mesh["ep"] if experts else None
    load_config = LoadStateDictConfig(
        pretrained_model_name_or_path=str(path), download_kwargs=download_kwargs, sharded_metadata=sharded_metadata,
        device_map=None if context.device.type == "cpu" else {"": context.device}, dtype=dtype,
        dtype_plan=dtype_plan, device_mesh=mesh, weight_mapping=conversions)
    info, _ = model_class._load_pretrained_model(model, None, files, load_config)
    model_class._finalize_model_loading(model, load_config, info)
    if context.pp_size > 1:
        pipeline_stage.finish(model)
    if plan or experts:
        _own_storage(model)
    return model, plan, info


@torch.no_grad()
def _own_storage(model) -> None:
    """Copy every parameter and buffer into memory of its own (tensor parallelism only).

    ``transformers`` reads checkpoint tensors as views of the memory-mapped safetensors file (zero copy). A row
    slice (``Shard(0)``) is then a view into the whole tensor, and any view keeps the whole file mapped, with the
    pages the load touched (and the kernel's read-around) resident: measured on a 110 MB checkpoint at tp 2, about
    0.8x the checkpoint per rank instead of 0.5x. After the copies nothing refers to the mapping, which is released:
    a rank holds exactly its shard. Tied parameters stay one object (each is replaced once, under every name)."""
    from torch.distributed.tensor import DTensor

    replaced = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                own = (param._local_tensor if isinstance(param, DTensor) else param.data).clone()
                if isinstance(param, DTensor):
                    own = DTensor.from_local(own, param.device_mesh, param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride())
                replaced[id(param)] = torch.nn.Parameter(own, requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.clone()


def from_pretrained(model_class, pretrained_model_name_or_path, *, parallel=None, dtype=None, config=None,
                    revision=None, token=None, cache_dir=None, local_files_only: bool = False, subfolder: str = "",
                    progress: bool = True, output_loading_info: bool = False, **kwargs):
    """``transformers``' ``model_class`` loaded from a Hub id or folder, this rank holding only its shard.

    Options as on the native models: ``parallel`` (``ParallelConfig`` / ``ParallelContext``, checked against the
    type before any process group: see ``generic/support.py``), ``dtype`` (``None`` = fp32), the hub arguments;
    other keyword arguments override config attributes. ``progress`` is accepted for symmetry (``transformers``
    shows its own bar). Returns the model in eval mode with ``parallel_context`` set."""
    from transformers import AutoConfig, GenerationConfig

    from ..distributed.agreement import all_or_none

    del progress
    download_kwargs = {"cache_dir": cache_dir, "local_files_only": local_files_only, "token": token,
                       "revision": revision or "main", "subfolder": subfolder}
    if config is None or isinstance(config, (str, os.PathLike)):
        config, unused = AutoConfig.from_pretrained(
            config or pretrained_model_name_or_path, return_unused_kwargs=True, revision=revision, token=token,
            cache_dir=cache_dir, local_files_only=local_files_only, subfolder=subfolder, **kwargs)
        if unused:
            raise ValueError(f"Unknown from_pretrained option(s): {sorted(unused)}")
    else:
        config = copy.deepcopy(config)
        for key, value in kwargs.items():
            setattr(config, key, value)
    support.check_parallel(config, _parallel_config(parallel), model_class)  # before any collective
    context = _resolve_context(parallel)
    with all_or_none(context, f"from_pretrained({str(pretrained_model_name_or_path)!r})"):
        model, plan, info = _load(model_class, pretrained_model_name_or_path, config, context,
                                  _resolve_dtype(dtype), download_kwargs)
    if model.can_generate():
        try:
            model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path,
                                                                       **download_kwargs)
        except (OSError, ValueError):
            pass  # no generation_config.json: keep the one derived from the config, as transformers does
    _attach(model, context, plan).eval()
    return (model, info.to_dict()) if output_loading_info else model


def from_config(model_class, config, *, parallel=None, dtype=None, **kwargs):
    """A randomly initialized ``model_class``: ``transformers`` draws the full weights from the current seed (seed
    every rank alike), then each rank keeps its tensor-parallel slices (the same model tp=1 would start from)."""
    if kwargs:
        raise ValueError(f"Unknown from_config option(s): {sorted(kwargs)}")
    config = copy.deepcopy(config)
    support.check_parallel(config, _parallel_config(parallel), model_class)
    context = _resolve_context(parallel)
    dtype = _resolve_dtype(dtype)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    with torch.device(context.device):
        model = model_class._from_config(config, dtype=dtype)
    plan = _apply_tensor_parallel(model, context)  # slices the full local tensors: no communication
    if context.ep_size > 1:
        expert_parallel.apply(model, context)  # this rank's experts of the full tensors (building the mesh)
    if context.pp_size > 1:  # this rank's stages; the others' layers are freed
        pipeline_stage.cut(model, context, loaded=True)
    if plan:
        model.tie_weights()  # the split copies of a tied pair are one tensor again
    return _attach(model, context, plan)
