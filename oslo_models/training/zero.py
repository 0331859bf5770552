"""Data parallelism and ZeRO over the data-parallel group only, for a (tensor-)parallel model.

One entry point, :func:`shard_data_parallel`, takes a model built by ``oslo_models`` and the optimizer built on its
parameters, and returns the pair ready to train at ``zero_stage`` 0-3. Every variant works on the ``dp`` axis of the
model's ``ParallelContext``: tensor-parallel ranks hold *different* shards of a weight, so their gradients must never
be averaged together; each shard is averaged only with the replicas of the same shard (same tp rank).

=====  ==========================================  =====================================================
stage  what is sharded over dp                     engine and collectives (per optimizer step)
=====  ==========================================  =====================================================
0      nothing                                     torch DDP on the dp group: all-reduce of gradients
1      optimizer state (Adam moments)              DDP (all-reduce of gradients) + torch
                                                   ``ZeroRedundancyOptimizer`` on the dp group: each rank
                                                   steps the parameters it owns, then broadcasts them
2      optimizer state + gradients                 FSDP2 ``fully_shard`` on the dp sub-mesh with
                                                   ``reshard_after_forward=False``: all-gather of
                                                   parameters before forward, reduce-scatter of gradients
3      optimizer state + gradients + parameters    FSDP2 ``fully_shard``, ``reshard_after_forward=True``:
                                                   all-gather again before backward (1.5x stage 2 traffic)
=====  ==========================================  =====================================================

With pipeline parallelism (``pipeline_parallel_size > 1``) ``model.train_step`` runs the schedule, so the model is
not wrapped. Stages 0/1: the runner all-reduces each stage's gradients over dp itself; stage 1 shards the
optimizer state of each stage over its dp group. Stages 2/3 (torchtitan's FSDP x PP): each local pipeline stage
(the ``StageModule`` the schedule runs) is an FSDP2 root over the dp mesh with one unit per layer; torch's
``PipelineStage`` sees the ``FSDPModule`` and keeps gradients unsharded and unreduced between the microbatches of
a step (no reshard after backward), then reduce-scatters them once after the last microbatch. With experts (ep > 1)
at stages 0/1 the runner sums the experts' gradients over edp and divides by dp x cp, and ZeRO-1 partitions their
optimizer state over edp; at stages 2/3 each stage's expert units are FSDP2 units on the edp mesh (as below) and the
runner reduces nothing.

Context parallelism (cp > 1): cp ranks hold the same weights, so every stage shards over ``dp x cp`` flattened
(``dp_cp``), as DDP and ZeRO-1 reduce over it.

HSDP (``ParallelConfig.data_parallel_shard_size = k < dp``): FSDP2 on a 2D ``(dp_replicate, dp_shard)`` mesh of the
dp ranks (shard groups of ``k`` adjacent dp ranks): all-gathers and reduce-scatters run inside a shard group, and
an all-reduce of the gradient shards across the ``dp / k`` groups; parameters and optimizer state are sharded
``k`` ways and replicated ``dp / k`` ways.

``cpu_offload`` (stages 2 and 3) keeps the sharded parameters, gradients and optimizer state in host memory
(FSDP2 ``CPUOffloadPolicy``); the optimizer step then runs on the CPU.

With experts split over ``expert_parallel_size`` (ep > 1) the stacked expert tensors are their own FSDP2 units,
sharded over the expert-data-parallel group (``edp``: the dp ranks holding the same experts) instead of dp, their
reduce-scatter dividing by dp (see ``_fully_shard``); everything else is sharded over dp as usual.

FSDP2 shards each tensor-parallel *local* tensor along its dim 0 over dp, so a weight of a tp x dp layout ends up
split twice: over tp by the model's plan, over dp by FSDP. Transformer blocks (``model._no_split_modules``, the
same hint ``transformers`` and Accelerate use for wrapping) each become one FSDP unit, so only one block's
parameters are gathered at a time; the root unit holds the embeddings, final norm and (tied) head. A block that
shares a parameter with a module outside it (BERT/RoBERTa's embeddings, tied to the MLM decoder) is not made a unit:
FSDP2 lets a parameter belong to one unit only, so it stays in the root with its other copy (``fsdp_units``).
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from ..distributed.data_parallel import data_parallel, mark_gradients_reduced
from ..utils.model_protocol import protocol_of
from ..utils.modules import constructor_defaults as _constructor_defaults
from ..utils.modules import unwrap_model, unwrap_optimizer
from ..utils.training_state import training_state, update_training_state
from .layout_rules import check_training_layout

ZERO_STAGES = (0, 1, 2, 3)


def _param_groups_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's param groups with parameter *names* in place of tensors (to survive re-creation)."""
    names = {id(param): name for name, param in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError("the optimizer holds parameters that are not parameters of the model; build it with "
                             "model.parameters() (or param groups of them) before calling shard_data_parallel")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names[id(p)] for p in group["params"]]})
    return groups


def _check_fresh(optimizer: torch.optim.Optimizer) -> None:
    if any(optimizer.state.values()):
        raise ValueError("the optimizer already has state (it has stepped); shard it before training, and restore "
                         "state with oslo_models.training.load_checkpoint afterwards")


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that become their own FSDP unit: the model protocol's answer (``utils/model_protocol.py``; a
    native family's blocks, ``_no_split_modules``, that share no parameter with a module outside them)."""
    return protocol_of(model).fsdp_units(model)


def expert_units(model: nn.Module) -> list[nn.Module]:
    """The modules holding experts split over the expert-parallel group: the model protocol's answer."""
    return protocol_of(model).expert_units(model)


def _data_parallel_mesh(context):
    """``(mesh, shard group)``: the mesh FSDP2 shards dense parameters over and the group over which a gradient's
    dp shards are spread (what the gradient norm adds partial sums over). dp (``dp x cp`` flattened under context
    parallelism); HSDP: the 2D ``(dp_replicate, dp_shard)`` mesh (collective: every rank builds the whole
    ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh, dp ranks of one shard group adjacent)."""
    from torch.distributed.device_mesh import init_device_mesh

    shard = context.config.data_parallel_shard_size
    if shard is not None and shard < context.dp_size:
        sizes = (context.pp_size, context.dp_size // shard, shard, context.cp_size, context.tp_size)
        mesh = init_device_mesh(context.device.type, sizes,
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        hybrid = mesh["dp_replicate", "dp_shard"]
        return hybrid, hybrid.get_group("dp_shard")
    if context.cp_size > 1:  # dp x cp as one axis of its own mesh (the same ranks as context.dp_cp_group)
        sizes = (context.pp_size, context.dp_size * context.cp_size, context.tp_size)
        flat = init_device_mesh(context.device.type, sizes, mesh_dim_names=("pp", "dp_cp", "tp"))["dp_cp"]
        return flat, flat.get_group()
    return context.mesh["dp"], context.dp_group


def _fully_shard(model: nn.Module, mesh, *, reshard_after_forward: bool, cpu_offload: bool,
                 expert_mesh=None, dp_size: int = 1) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    if expert_mesh is not None:
        # Experts: their own units, sharded over edp (the ranks holding the same experts). Their gradient must be
        # the sum over edp divided by dp (the all-to-all backward already summed the ep ranks' tokens: the same rule
        # as the DDP path, distributed/expert_parallel.py); FSDP2's reduce-scatter averages over edp, so the
        # model protocol makes it divide by dp instead.
        protocol = protocol_of(model)
        for module in protocol.expert_units(model):
            fully_shard(module, **{**options, "mesh": expert_mesh})
            protocol.divide_expert_gradients(module, expert_mesh.size(), dp_size)
    for module in fsdp_units(model):
        fully_shard(module, **options)
    # The root keeps what no block owns; its parameters are needed first and last, so never reshard them early.
    fully_shard(model, **{**options, "reshard_after_forward": False})


def _zero_redundancy(optimizer: torch.optim.Optimizer, context, model=None):
    """ZeRO-1: torch's ``ZeroRedundancyOptimizer`` over the dp group, same optimizer class and param groups
    (with experts: dense parameters over dp, experts over the expert-data-parallel group)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if context.ep_size > 1:
        from ..distributed.expert_parallel import split_optimizer

        def build(groups, group):
            if group is None:
                return type(optimizer)([dict(g) for g in groups], **_constructor_defaults(optimizer))
            return ZeroRedundancyOptimizer([dict(g) for g in groups], optimizer_class=type(optimizer),
                                           process_group=group, **_constructor_defaults(optimizer))

        return split_optimizer(unwrap_model(model), optimizer, build)

    # Whole tensors are partitioned over the dp (x cp) ranks by size; process_group=dp_cp_group, never the world.
    # Groups keep their own hyperparameters (and a scheduler's initial_lr).
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=context.dp_cp_group,
                                   **_constructor_defaults(optimizer))


def _pipeline_data_parallel(model, optimizer, context, stage: int, ddp_kwargs: dict):
    """pp > 1, stages 0/1: ``model.train_step`` already all-reduces each stage's gradients over dp (the schedule,
    not ``forward``, runs the stage, so a DDP wrapper would never fire). Only the optimizer is sharded (ZeRO-1)."""
    if ddp_kwargs:
        raise ValueError(f"DDP options {sorted(ddp_kwargs)} do not apply with pipeline_parallel_size > 1 (the "
                         f"pipeline runner synchronizes gradients itself)")
    if stage == 1 and optimizer is not None:
        from .dtensor_data_parallel import ShardedStateOptimizer, _expert_group, has_dtensor_parameters

        # torch's ZeroRedundancyOptimizer cannot broadcast DTensors: the unpipelined DTensor ZeRO-1 (each
        # parameter's state on one dp rank, its local tensor broadcast; experts within edp). So too for a generic
        # model with experts (no parallel_plan naming them) on a stage that holds none (dots1's dense first layer)
        generic_experts = context.ep_size > 1 and not hasattr(unwrap_model(model), "parallel_plan")
        if has_dtensor_parameters(model) or generic_experts:
            optimizer = ShardedStateOptimizer(optimizer, context, _constructor_defaults(optimizer),
                                              expert_group=_expert_group(model, context))
        else:
            optimizer = _zero_redundancy(optimizer, context, model)  # experts: their state over edp
    update_training_state(model, zero_stage=stage)
    mark_gradients_reduced(model, "pipeline")
    return model, optimizer


def _pipeline_fully_shard(model, mesh, *, reshard_after_forward: bool, cpu_offload: bool,
                          expert_mesh=None, dp_size: int = 1) -> None:
    """pp > 1, stages 2/3: every local pipeline stage becomes an FSDP2 root (``StageModule``, built once here and
    reused by the runner's schedules), each of its layers a unit inside it; the root keeps the stage's embeddings,
    final norm and head. torch's ``PipelineStage`` drives it: no gradient sync nor reshard after the backward of
    every microbatch but the last, one reduce-scatter per step (``perform_reduce_grad``).

    With experts (``expert_mesh``, ep > 1) each expert unit of a stage's layers is its own FSDP2 unit on the
    expert-data-parallel mesh, its reduce-scatter giving the sum over edp divided by ``dp_size`` (as
    :func:`_fully_shard`); the runner then reduces nothing itself (``PipelineRunner.sync_gradients``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from ..pipeline.stage import StageModule

    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    layout = model.pipeline_layout
    modules, seen = {}, set()
    for index in layout.local_stages:
        # sequence_parallel is set per schedule by the runner (it depends on the batch's sequence length)
        module = StageModule(model, index, layout, sequence_parallel=False)
        ids = [id(layer) for layer in module.layers]
        if len(set(ids)) < len(ids) or seen & set(ids):
            # one FSDP2 unit per layer module: a module run at several depths of this rank's stages (ALBERT's
            # shared layer groups) would be one unit gathered and resharded per use, or two roots' unit
            raise ValueError(f"ZeRO-2/3 under pipeline parallelism shards each layer of a stage as one unit; "
                             f"{type(model).__name__} runs one layer module at several depths of its local stages "
                             f"(shared layer parameters), which that sharding does not cover: use zero_stage=1 "
                             f"(or 0) with pipeline parallelism for it")
        seen.update(ids)
        if expert_mesh is not None:
            protocol = protocol_of(model)
            for unit in protocol.expert_units(model):
                if any(unit is sub for layer in module.layers for sub in layer.modules()):
                    fully_shard(unit, **{**options, "mesh": expert_mesh})
                    protocol.divide_expert_gradients(unit, expert_mesh.size(), dp_size)
        for layer in module.layers:
            fully_shard(layer, **options)
        fully_shard(module, **{**options, "reshard_after_forward": False})
        modules[index] = module
    update_training_state(model, stage_modules=modules)


def shard_data_parallel(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                        zero_stage: int | None = None, cpu_offload: bool = False, **ddp_kwargs):
    """Make ``model`` (and ``optimizer``) data parallel over the model's dp group at ``zero_stage``.

    Args:
        model: an ``oslo_models`` model (it carries ``parallel_context``), not wrapped yet.
        optimizer: a fresh optimizer over ``model.parameters()`` (any torch optimizer; its class, param groups and
            hyperparameters are kept). Stages 2/3 replace the parameters with DTensors, so the optimizer is rebuilt
            on them; stage 1 wraps it in ``ZeroRedundancyOptimizer``.
        zero_stage: 0-3; default ``model.parallel_context.config.zero_stage``.
        cpu_offload: stages 2/3 only: parameters, gradients and optimizer state in host memory (the same as
            ``ParallelConfig.offload="cpu"``).

    With ``ParallelConfig.offload="nvme"`` the returned optimizer is a
    :class:`~oslo_models.training.nvme_offload.DiskOffloadedOptimizer`: the Adam state of this rank's local shards in
    a scratch file under ``offload_path`` (its folder is checked and locked on every rank, agreeing on the outcome,
    before FSDP2 or DDP run any collective).

    Returns ``(model, optimizer)``: use the returned objects for forward, backward and step. With one dp rank the
    model is returned unwrapped and the optimizer unchanged (there is nothing to shard).
    """
    context = getattr(unwrap_model(model), "parallel_context", None)
    if context is None:
        raise ValueError("shard_data_parallel needs an oslo_models model (with .parallel_context)")
    if model is not unwrap_model(model) or training_state(model).zero_stage is not None:
        raise ValueError("the model is already wrapped for data parallelism; pass the plain model")
    stage = context.config.zero_stage if zero_stage is None else zero_stage
    cpu_offload = cpu_offload or context.config.offload == "cpu"
    check_training_layout(context.config, zero_stage=stage, cpu_offload=cpu_offload,
                          compiled=getattr(model, "_orig_mod", None) is not None)
    refusal = protocol_of(model).training_refusal(unwrap_model(model))
    if refusal is not None:
        raise NotImplementedError(refusal)
    if stage != context.config.zero_stage and context.pp_size > 1:  # the model's rules at this stage (ALBERT x pp)
        protocol_of(model).check_layout(unwrap_model(model), dataclasses.replace(context.config, zero_stage=stage))
    if context.config.offload != "nvme" or optimizer is None:
        return _shard_data_parallel(model, optimizer, context, stage, cpu_offload, ddp_kwargs)
    from ..distributed.agreement import all_or_none
    from .nvme_offload import DiskOffloadedOptimizer, prepare_offload_folder, release_offload_folder

    inner = unwrap_optimizer(optimizer)
    if context.config.offload_params and context.device.type != "cpu":
        raise NotImplementedError(f"offload_params=True is implemented for CPU devices (FSDP2 keeps the shards on "
                                  f"{context.device.type} there); use offload_params=False (optimizer state on disk)")
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(f"offload='nvme' offloads torch.optim.Adam / AdamW state; got {type(inner).__name__}")
    _check_fresh(inner)
    with all_or_none(context, "offload='nvme': preparing the offload folder"):  # every rank raises, or none
        state = _predicted_state_bytes(inner, context, stage, unwrap_model(model))
        keys = 3 if any(g.get("amsgrad") for g in inner.param_groups) else 2
        folder = prepare_offload_folder(context.config.offload_path, context.rank,
                                        state + (state // keys if context.config.offload_params else 0),
                                        local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    try:
        model, optimizer = _shard_data_parallel(model, optimizer, context, stage, cpu_offload, ddp_kwargs)
        optimizer = DiskOffloadedOptimizer.wrap(optimizer, folder)
        if context.config.offload_params:  # the parameter shards move into the same folder (deleted on close)
            from .nvme_params import ParameterFile

            ParameterFile(model, folder).attach(optimizer)
        return model, optimizer
    except BaseException:
        release_offload_folder(folder)  # the lock of a failed setup must not block the next try
        raise


def _predicted_state_bytes(optimizer, context, stage: int, model) -> int:
    """Adam's state bytes on this rank after sharding: ZeRO-2/3 split each local tensor's dim 0 over the shard group
    (``torch.chunk``'s rounding up: an upper bound); experts (ep > 1) over the expert-data-parallel group instead."""
    from .nvme_offload import _local, predicted_state_bytes

    dense = context.config.data_parallel_shard_size or context.dp_cp_size if stage >= 2 else 1
    experts = set()
    if context.ep_size > 1:  # the model protocol's expert units (a generic model has no parallel_plan)
        experts = {id(p) for unit in protocol_of(model).expert_units(getattr(model, "_orig_mod", model))
                   for p in unit.parameters()}
    sizes = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            local = _local(param)
            numel = local.numel()
            shard = (context.edp_size if stage >= 2 else 1) if id(param) in experts else dense
            if shard > 1 and local.dim() and local.shape[0]:
                numel = -(-local.shape[0] // shard) * (numel // local.shape[0])
            sizes.append((numel, local.element_size()))
    return predicted_state_bytes(sizes, amsgrad=any(g.get("amsgrad") for g in optimizer.param_groups))


def _shard_data_parallel(model, optimizer, context, stage: int, cpu_offload: bool, ddp_kwargs: dict):
    shard = context.config.data_parallel_shard_size
    if shard is not None and shard < context.dp_size and stage < 2:
        raise ValueError(f"the model's ParallelConfig asks for HSDP (data_parallel_shard_size={shard}), which needs "
                         f"zero_stage 2 or 3, got zero_stage={stage}")
    if optimizer is not None:
        optimizer = unwrap_optimizer(optimizer)
        _check_fresh(optimizer)
    plan = context.config.block_plan
    if plan is not None:  # checked before any collective (training/per_block.py)
        from .per_block import check_block_plan

        if stage != 3:
            raise ValueError(f"the model's ParallelConfig has a block_plan, applied by the FSDP2 engine: it needs "
                             f"zero_stage=3, got zero_stage={stage}")
        refusal = protocol_of(model).block_plan_refusal
        if refusal:
            raise NotImplementedError(refusal)
        if cpu_offload:
            raise NotImplementedError("a block_plan with cpu_offload is not implemented: offload policies are per "
                                      "engine, not per block")
        check_block_plan(model, plan)
    if context.dp_cp_size == 1 and not cpu_offload and not context.config.offload_params:
        # (one dp rank: nothing to shard; offload_params still needs FSDP2's units, whose shards go to the file)
        update_training_state(model, zero_stage=stage)
        return model, optimizer

    if context.pp_size > 1 and stage <= 1:
        return _pipeline_data_parallel(model, optimizer, context, stage, ddp_kwargs)
    if stage <= 1:
        from .dtensor_data_parallel import has_dtensor_parameters, shard_dtensor_data_parallel

        if has_dtensor_parameters(model):  # e.g. tensor parallel through a transformers plan: DDP cannot hold them
            return shard_dtensor_data_parallel(model, optimizer, context, stage, ddp_kwargs)
        wrapped = data_parallel(model, context, **ddp_kwargs)
        if stage == 1 and optimizer is not None:
            optimizer = _zero_redundancy(optimizer, context, model)
        mark_gradients_reduced(wrapped, f"zero{stage}" if stage else "ddp")
        update_training_state(wrapped, zero_stage=stage)
        return wrapped, optimizer

    refusal = protocol_of(model).pipeline_sharding_refusal(model) if context.pp_size > 1 else None
    if refusal:
        raise NotImplementedError(refusal)
    if context.mesh is None:
        raise ValueError("zero_stage 2/3, cpu_offload and offload_params need torch.distributed (launch with "
                         "torchrun or accelerate launch)")
    if ddp_kwargs:
        raise ValueError(f"DDP options {sorted(ddp_kwargs)} do not apply to zero_stage {stage} (FSDP2)")
    groups = _param_groups_by_name(model, optimizer) if optimizer is not None else None
    mesh, shard_group = _data_parallel_mesh(context)
    if context.pp_size > 1:
        # the stages are cut in the model a peft wrapper holds (LoRA): its runner reads the FSDP2 roots from there
        stages_owner = model.get_base_model() if hasattr(model, "peft_config") else model
        expert_mesh = (protocol_of(stages_owner).expert_data_parallel_mesh(stages_owner, context)
                       if context.ep_size > 1 else None)
        _pipeline_fully_shard(stages_owner, mesh, reshard_after_forward=stage == 3, cpu_offload=cpu_offload,
                              expert_mesh=expert_mesh, dp_size=context.dp_cp_size)
    elif plan is not None:  # per block: sharded or replicated (training/per_block.py)
        from .per_block import fully_shard_blocks

        fully_shard_blocks(model, mesh, context, plan)
    else:
        expert_mesh = (protocol_of(model).expert_data_parallel_mesh(model, context) if context.ep_size > 1
                       else None)
        _fully_shard(model, mesh, reshard_after_forward=stage == 3, cpu_offload=cpu_offload,
                     expert_mesh=expert_mesh, dp_size=context.dp_cp_size)  # ep is carved out of dp x cp
    # the gradient norm adds dp partial sums over the shard group (clip.py)
    update_training_state(model, zero_stage=stage, fsdp_shard_group=shard_group)
    mark_gradients_reduced(model, f"fsdp2 zero{stage}")
    if optimizer is not None:
        params = dict(model.named_parameters())
        rebuilt = [{**group, "params": [params[name] for name in group["params"]]} for group in groups]
        optimizer = type(optimizer)(rebuilt, **_constructor_defaults(optimizer))
    return model, optimizer


def zero_stage_of(model: nn.Module) -> int:
    """The ZeRO stage ``model`` was prepared with (0 when it was not prepared)."""
    return training_state(model).zero_stage or 0
