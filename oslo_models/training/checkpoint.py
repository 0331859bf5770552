"""Training checkpoints (model, optimizer, scheduler, data position, RNG) that resume at any tp x dp layout.

Format: a folder written with ``torch.distributed.checkpoint`` (DCP) plus two small side files:

- DCP entries ``model/<param name>`` and ``optim/<param name>/<state key>`` hold every tensor in a *canonical*,
  layout-independent shape, as a DTensor sharded over the tensor-parallel mesh axis (plain tensor at tp=1). The
  model's plan (each parameter's ``Layout``, ``dcp_view``) says how: a column/row split is ``Shard(dim)``; equal
  packed q|k|v blocks are viewed as ``[..., num_packed, block, ...]`` and sharded on the block dim; a padded
  vocabulary drops its padding rows, which is exactly ``Shard(0)``'s uneven chunking; what no single ``Shard(dim)``
  expresses (grouped-query key/value heads replicated over tp ranks at ``tp > num_key_value_heads``, unequal packed
  blocks) is gathered and stored whole, each element once. Under the grid modes (2D / 2.5D / 3D) a weight block
  is a box split along two dims (``GridBlock``: each dim's layout views it in turn), a DTensor ``Shard(dim)`` over
  each of its grid axes (a combined axis such as 3D's ``("tp_col", "tp_dep")`` is one mesh dim; ``_mesh``), so a
  grid checkpoint holds the same entries, of the same shapes, as a 1D one. DCP stores each chunk once (replicas
  over dp, or over a grid axis a block is not split on, are de-duplicated) and on load reads, for every rank of
  the *new* layout, just the slice it owns - so tp=2 x dp=2 resumes at tp=4 or tp=1 x dp=2, 2D at 1D and back, 3D
  at 2.5D, with no conversion step. Context-parallel ranks hold replicas like dp ranks (ZeRO-1 shards the
  optimizer state over dp x cp, each shard written by its owner), so
  cp2 x dp2 resumes at cp1 x dp4 the same way. Stacked experts split over
  ``expert_parallel_size`` (layout axis ``"ep"``) are ``Shard(0)`` over a one-axis mesh of the rank's ep
  group (the same on every tp rank), so ep 2 resumes at ep 4 the same way; their ZeRO-1 state lives in the
  experts' own optimizer (``SplitOptimizer``, sharded over edp), their ZeRO-2/3 shards on the edp mesh.
- Pipeline stages hold disjoint parameters, so their entries are disjoint and the same canonical names are written
  at every pp layout: a tied tensor with copies on several stages (GPT-2's ``wte``/``lm_head``, a tied Qwen2's
  embedding) is written once, under the name its lowest pipeline rank holds (the name a pp=1 model keeps); a stage
  whose copy has another name reads it (and its optimizer state) from there. pp 2 resumes at pp 1 or pp 2 x tp 2.
- ``trainer_state.pt`` (rank 0): step, scheduler, loader/sampler position, optimizer hyperparameters, loss scaler,
  the layout, user extras. ``rng/rank<k>.pt`` (every rank): torch/CUDA/numpy/python RNG and the tensor-parallel RNG
  tracker. RNG is restored only at the same layout (a rank of another layout has another role).

ZeRO: under FSDP2 (stages 2/3) each tensor is first all-gathered over dp (``full_tensor``), one tensor at a time;
under ZeRO-1 only the rank that owns a parameter's optimizer state writes it and only the new owner reads it.
Folders (``checkpoint_folders``): ``path`` holds ``step-N`` folders and a ``latest`` pointer. A save goes to
``.step-N.partial``, is fsynced, renamed into place and pointed at; older steps are removed only after that, so a
crash at any instant leaves the last complete checkpoint loadable (``find_checkpoint`` finds it). A rank that
fails to write makes every rank raise the same error (``distributed.agreement``; DCP's ``CheckpointException`` is
turned into the failing rank's own ``OSError``, errno kept), the partial folder is removed and ``latest`` keeps
naming the previous step; a rank that calls ``save_checkpoint``/``load_checkpoint`` alone gets a clear error within
seconds instead of a hang. Non-finite weights are refused before anything is written. Each step folder records the
size and SHA-256 of its files (``checkpoint_integrity``); a load verifies them before reading any tensor and, with
``fallback=True``, falls back to the previous complete step.

Collectives: a store-based arrival check, DCP's plan exchange (gather/scatter of metadata), FSDP2 all-gathers,
and small ``all_gather_object`` agreements after the rank-local steps.
"""
from __future__ import annotations

import os
import sys
import time
import weakref

import numpy as np
import torch

from ..conversion.atomic import fsync_path
from ..conversion.saving import run_on_main_process
from ..distributed.agreement import _lineage, agree_on_failure, all_or_none, check_arrival, rebuild_error
from ..utils.model_protocol import protocol_of
from ..utils.training_state import training_state
from . import checkpoint_hub
from .checkpoint_folders import (
    MARKER,
    describe_missing,
    find_checkpoint,
    older_complete,
    partial_dir,
    prepare_partial,
    publish_step,
    remove_partial,
    step_dir_name,
)
from .checkpoint_integrity import CHECKSUMS, CorruptCheckpointError, record_checksums, verify_checksums
from .checkpoint_rng import restore_rng as _restore_rng
from .checkpoint_rng import rng_state as _rng_state
from .finite import NonFiniteError
from .zero import unwrap_model, unwrap_optimizer

_TRAINER_STATE = "trainer_state.pt"
_RULE = "every rank calls it (each writes or reads its own part)"


def _save_synced(obj, path: str) -> None:
    torch.save(obj, path)
    fsync_path(path)


# ---------------------------------------------------------------------------------------------- canonical form
def _canonical(local: torch.Tensor, spec, context):
    """``(view, global_shape, shards)``: ``local`` (a tp-local tensor) as a box of the layout-independent tensor
    (``Layout.dcp_view``). A layout that no box expresses (replicated key/value heads, unequal packed blocks) is
    gathered and stored whole."""
    canonical = spec.dcp_view(local, context)
    if canonical is None:
        full = spec.gather_local(local, context)
        return full, tuple(full.shape), ()
    return canonical


_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # context -> {axes: DeviceMesh}


def _mesh(context, axes: tuple):
    """A DeviceMesh of this rank's ranks along ``axes`` (one mesh dim per entry; a tuple of names is one dim,
    combined outermost first), for DCP to place boxes by. ``("ep",)``: the expert-parallel group. Otherwise the
    names are the tensor-parallel grid's (``"tp"`` is all of them flattened): the mesh is cut from the tp group's
    ranks laid out as the grid (innermost axis last), at this rank's position on the axes it leaves out. Built
    without process groups (``_init_backend=False``): DCP only asks a DTensor's mesh for this rank's coordinates,
    and a combined axis such as 3D's ``("tp_col", "tp_dep")`` has no group of its own."""
    cache = _MESHES.setdefault(context, {})
    if axes in cache:
        return cache[axes]
    from torch.distributed.device_mesh import DeviceMesh

    if axes == ("ep",):
        mesh = DeviceMesh.from_group(context.ep_group, context.device.type, mesh=list(context.axis("ep").ranks),
                                     mesh_dim_names=("ep",))
    else:
        from ..distributed.context import TP_SUB_AXES
        from ..parallel_layers.sharding import axis_names

        grid_names = TP_SUB_AXES[context.tensor_parallel_mode] or ("tp",)
        groups = [grid_names if axis == "tp" else axis_names(axis) for axis in axes]
        used = [name for group in groups for name in group]
        if len(set(used)) != len(used) or not set(used) <= set(grid_names):
            raise NotImplementedError(f"a tensor split over mesh axes {axes} cannot be checkpointed as a box; its "
                                      "layout's dcp_view should return None (stored whole)")
        grid = torch.tensor(context.axis("tp").ranks).reshape([context.axis(name).size for name in grid_names])
        grid = grid[tuple(slice(None) if name in used else context.axis(name).rank for name in grid_names)]
        kept = [name for name in grid_names if name in used]  # grid order; permuted to the layout's order
        grid = grid.permute([kept.index(name) for name in used])
        grid = grid.reshape([int(np.prod([context.axis(name).size for name in group])) for group in groups])
        mesh = DeviceMesh(context.device.type, grid, _init_backend=False, _rank=context.rank)
    cache[axes] = mesh
    return mesh


def _to_dcp(view: torch.Tensor, full_shape, shards, context):
    """The DCP value: ``view`` as this rank's box of a DTensor of ``full_shape``, ``Shard(dim)`` over each of
    ``shards``' mesh axes, or itself when not sharded (DCP then stores one replica of it)."""
    if not shards:
        return view
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh(context, tuple(axis for _, axis in shards))
    stride = torch.empty(full_shape, device="meta").stride()
    return DTensor.from_local(view, mesh, [Shard(dim) for dim, _ in shards], run_check=False, shape=full_shape,
                              stride=stride)


def _tp_local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor-parallel-local value: FSDP2 DTensors (sharded over dp) are all-gathered over dp."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _set_tp_local(target: torch.Tensor, value: torch.Tensor, context) -> None:
    """Write a tp-local ``value`` into ``target``; for an FSDP2 DTensor only this rank's dim-0 chunk over the
    DTensor's own mesh (dp, dp x cp, or edp for experts split over ep; HSDP: a 2D ``(replicate, shard)`` mesh,
    chunked over its ``Shard`` dim only)."""
    if hasattr(target, "to_local"):
        mesh = target.device_mesh
        local = target.to_local()
        for dim, placement in enumerate(target.placements):
            if placement.is_shard():
                chunks = value.chunk(mesh.size(dim), dim=0)  # FSDP2's Shard(0) uses torch.chunk's uneven split
                rank = mesh.get_local_rank(dim)
                if rank < len(chunks):
                    local.copy_(chunks[rank])
                return
        local.copy_(value)
        return
    target.copy_(value)


def _local_optimizers(optimizer) -> list:
    """The optimizers that hold this rank's state: ZeroRedundancyOptimizer keeps its shard in ``.optim``; with
    experts (``SplitOptimizer``) one per kind (dense over dp, experts over edp)."""
    parts = [inner for inner, _ in optimizer.inner] if hasattr(optimizer, "inner") else [optimizer]
    return [getattr(part, "optim", part) for part in parts]


def _state_holder(optimizer, param):
    """The local optimizer whose param groups hold ``param`` (``None``: another dp rank owns its state)."""
    for holder in _local_optimizers(optimizer):
        if any(param is p for group in holder.param_groups for p in group["params"]):
            return holder
    return None


# ---------------------------------------------------------------------------------------------- save
def _layout(context) -> dict:
    layout = {"tp": context.tp_size, "dp": context.dp_size, "pp": context.pp_size, "world": context.world_size}
    if context.ep_size > 1:  # only then: layouts saved without experts compare as before
        layout["ep"] = context.ep_size
    if context.cp_size > 1:  # (likewise) a cp rank's RNG belongs to its chunk: restored at the same cp only
        layout["cp"] = context.cp_size
    if context.is_grid:  # (likewise) a grid rank's RNG streams belong to its grid position: same mode only
        layout["tp_mode"] = context.tensor_parallel_mode
        if context.config.tensor_parallel_depth > 1:
            layout["tp_depth"] = context.config.tensor_parallel_depth
    return layout


def _unwrap_scheduler(scheduler):
    return getattr(scheduler, "scheduler", scheduler)


def reshard_fsdp_units(model) -> None:
    """Reshard every FSDP2 unit of ``model`` (no collective: it frees the gathered parameters and registers the
    sharded ones again; nothing to do where they are sharded). A forward under ``no_grad`` (an evaluation) leaves the
    root unit's parameters gathered, since no backward follows to reshard them; a checkpoint of that state crashed a
    rank with SIGSEGV in torch.distributed.checkpoint's writer at ZeRO-3 x dp 2 (``train_clm.py --eval-data``)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def save_checkpoint(path, model, optimizer=None, scheduler=None, *, dataloader=None, scaler=None, step: int = 0,
                    extra: dict | None = None, keep: int = 1, async_: bool = False) -> str:
    """Save a resumable training checkpoint as ``path/step-<step>`` and point ``path/latest`` at it (call on every
    rank). Returns the step folder. ``keep``: how many step folders to keep (the newest ones).

    ``model``/``optimizer``/``scheduler`` may be the objects returned by :func:`prepare` or
    :func:`shard_data_parallel`. ``dataloader``: anything with ``state_dict()`` (``oslo_models.data`` loaders).
    ``scaler``: a ``GradScaler`` (``accelerator.scaler``). ``extra``: small picklable-free values (numbers,
    strings, lists, dicts, tensors) returned by :func:`load_checkpoint`.

    ``async_=True``: the state is copied to host memory (pinned on CUDA) and written by a background thread while
    training goes on (``async_checkpoint.py``); the call returns the folder the step will have once written. At most
    one save is in flight: the next ``save_checkpoint`` (or ``load_checkpoint``, or
    :func:`wait_for_checkpoint`) first waits for it, and raises its failure if it failed. ``latest`` names the step
    only after every rank's files are written.

    Raises on every rank alike: ``NonFiniteError`` when a weight holds NaN/inf on any rank (nothing written), and the
    failing rank's error (e.g. ``OSError`` ENOSPC, naming rank and file) when a write fails anywhere; either way
    ``latest`` still names the previous step. Collectives: an arrival check, small ``all_gather_object``
    agreements, DCP's plan exchange, FSDP2 all-gathers.
    """
    path = os.path.abspath(os.fspath(path))
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"save_checkpoint keep= must be a positive int, got {keep!r}")
    inner = unwrap_model(model)
    context, plan = inner.parallel_context, getattr(inner, "parallel_plan", None)
    writer = None
    if async_:
        from .async_checkpoint import async_writer

        writer = async_writer(inner)  # (the first call makes its process group: every rank calls it)
        writer.wait()  # the previous save: done, or its failure raised here
    else:
        wait_for_checkpoint(inner)
    check_arrival(context, "save_checkpoint", _RULE)
    reshard_fsdp_units(model)
    with all_or_none(context, f"save_checkpoint({path!r}) at step {step}"):
        _refuse_nonfinite(inner)  # never a NaN checkpoint over the last good one
    run_on_main_process(context, prepare_partial, path, step, what=f"save_checkpoint({path!r}) preparing")
    try:
        began = time.perf_counter()
        captured = _capture(inner, context, plan, optimizer, scheduler, dataloader, scaler, step, extra)
        if writer is not None:
            return writer.start(path, step, captured, keep, _write_step, capture_seconds=time.perf_counter() - began)
        return _write_step(path, step, *captured, context=context, keep=keep)
    except Exception:
        # every rank raised the same (agreed) error and stopped writing: free the space the partial save took
        if context.is_main_process:
            remove_partial(path, step)
        raise


def wait_for_checkpoint(model) -> str | None:
    """Wait for the asynchronous :func:`save_checkpoint` of ``model`` in flight, if any; return the step folder
    it wrote (``None`` when none was in flight) or raise its failure. Call on every rank (before exiting, or to
    be sure the last checkpoint is on disk)."""
    writer = training_state(model).async_writer
    return None if writer is None else writer.wait()


def _refuse_nonfinite(inner) -> None:
    for name, param in inner.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if not torch.isfinite(local.detach()).all():
            raise NonFiniteError(f"parameter {name} holds NaN/inf on rank {inner.parallel_context.rank}: refusing to "
                                 "save it (the last good checkpoint is kept)")


def _raise_clear(error: BaseException, what: str):
    """DCP's ``CheckpointException`` (a ``BaseException`` listing each failing rank's exception, raised on every
    rank) as the first failing rank's own error type and message, the same on every rank."""
    failures = getattr(error, "failures", None)
    if not failures:
        raise error
    rank = min(failures)
    original = failures[rank][0]
    text = f"{what} failed on rank {rank}: {type(original).__name__}: {original}"
    if len(failures) > 1:
        text += f" (ranks {sorted(failures)[1:]} failed too)"
    raise rebuild_error(_lineage(type(original)), text, getattr(original, "errno", None)) from None


def _tied_aliases(inner, metadata) -> dict[str, str]:
    """Pipeline stages: ``{parameter name: stored name}`` for this rank's copies of a tied tensor stored under
    another name of its group (a last stage's ``lm_head.weight`` saved as ``transformer.wte.weight``)."""
    if getattr(inner, "pipeline_layout", None) is None:
        return {}
    from ..pipeline.adapter import adapter_for

    aliases = {}
    for names in adapter_for(inner).tied_groups(inner):
        stored = [name for name in names if f"model/{name}" in metadata]
        for name in names:
            if f"model/{name}" not in metadata and stored:
                aliases[name] = stored[0]
    return aliases


def _native_state(inner, opt, context, plan) -> dict:
    """The DCP state dict of a native model (canonical views from its plan) and this rank's optimizer state.
    Copies of a tied tensor on higher pipeline ranks are left out (the lowest rank's copy stands for them)."""
    from ..pipeline.stage import tied_duplicates

    state = {}
    duplicates = tied_duplicates(inner)
    params = {name: param for name, param in inner.named_parameters() if name not in duplicates}
    for name, param in params.items():
        view, full, shards = _canonical(_tp_local(param.detach()), plan.shard_spec(inner, name), context)
        state[f"model/{name}"] = _to_dcp(view.contiguous(), full, shards, context)
    all_param_names = {name for name, _ in inner.named_parameters(remove_duplicate=False)}
    for name, buffer in inner.state_dict().items():
        if name not in all_param_names:  # persistent buffers: replicated
            state[f"model/{name}"] = buffer.detach()
    if opt is not None:
        for name, param in params.items():
            holder = _state_holder(opt, param)
            for key, value in (holder.state.get(param, {}) if holder is not None else {}).items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"optimizer state {name}/{key} is not a tensor ({type(value).__name__}); "
                                     "only tensor optimizer state can be checkpointed")
                value = _tp_local(value.detach())
                if value.dim() == 0:
                    state[f"optim/{name}/{key}"] = value
                else:
                    view, full, shards = _canonical(value, plan.shard_spec(inner, name), context)
                    state[f"optim/{name}/{key}"] = _to_dcp(view.contiguous(), full, shards, context)
    return state


def _capture(inner, context, plan, optimizer, scheduler, dataloader, scaler, step, extra) -> tuple:
    """``(DCP state dict, RNG state, trainer state or None, Hub map)`` of this rank: the values to write (views of
    the live tensors; an asynchronous save copies them). Collective under ZeRO-2/3 (FSDP2 all-gathers)."""
    opt = unwrap_optimizer(optimizer)
    if protocol_of(inner).layout == "placements":  # its DTensors go to DCP as they are
        from ..generic.checkpoint import state_to_save

        state = state_to_save(inner, opt)
    else:
        state = _native_state(inner, opt, context, plan)
    trainer_state = None
    if context.is_main_process:
        trainer_state = {
            "step": int(step), "layout": _layout(context), "extra": extra or {},
            "param_groups": ([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                             if opt is not None else None),
            "scheduler": _unwrap_scheduler(scheduler).state_dict() if scheduler is not None else None,
            "dataloader": dataloader.state_dict() if dataloader is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
    return state, _rng_state(context), trainer_state, checkpoint_hub.capture(inner, context, plan)


def _write_step(path, step, state, rng_state, trainer_state, hub, *, context, keep, group=None) -> str:
    """Write a captured state into ``.step-N.partial``, record checksums, publish it and point ``latest`` at it.
    Collectives only over ``group`` (default: the world's): DCP's plan exchange and the agreements."""
    import torch.distributed.checkpoint as dcp  # here, not at import: it costs ~1 s of `import oslo_models`

    partial = partial_dir(path, step)
    try:
        dcp.save(state, checkpoint_id=partial, process_group=group)  # a failed write: CheckpointException
    except BaseException as error:  # noqa: BLE001 - CheckpointException is a BaseException
        if type(error).__name__ != "CheckpointException":
            raise
        _raise_clear(error, f"save_checkpoint({path!r}) writing tensors")
    error = None
    try:
        os.makedirs(os.path.join(partial, "rng"), exist_ok=True)
        _save_synced(rng_state, os.path.join(partial, "rng", f"rank{context.rank}.pt"))
        if trainer_state is not None:
            _save_synced(trainer_state, os.path.join(partial, _TRAINER_STATE))
    except Exception as caught:  # noqa: BLE001 - raised on every rank by the agreement
        error = caught
    maps = agree_on_failure(context, error, what=f"save_checkpoint({path!r}) writing the RNG / trainer state",
                            value=hub["tensors"], group=group)
    with all_or_none(context, f"save_checkpoint({path!r}) writing {checkpoint_hub.HUB_DIR}/", group=group):
        if context.rank == 0:  # what the offline consolidation into a Hub folder needs (checkpoint_hub.py)
            checkpoint_hub.write(partial, maps, hub["configs"])
    checksums = record_checksums(context, partial, exclude=(MARKER, CHECKSUMS),
                                 what=f"save_checkpoint({path!r}) recording checksums", group=group)
    error = None
    if context.rank == 0:
        try:
            publish_step(path, step, keep=keep, checksums=checksums)
        except Exception as caught:  # noqa: BLE001 - raised on every rank below
            error = caught
    agree_on_failure(context, error, what=f"save_checkpoint({path!r}) publishing", group=group)
    return os.path.join(path, step_dir_name(step))


# ---------------------------------------------------------------------------------------------- load
def _target(shape, dtype, spec, context, key, metadata):
    """``(buffer, view, dcp value, cut)``: a zero tp-local buffer, its canonical view (what DCP loads into) after a
    check of the saved global shape, and for a tensor stored whole (see ``_canonical``) ``cut()``, which copies this
    rank's piece out of the loaded full view into the buffer (``None`` when the view is the buffer's own)."""
    buffer = torch.zeros(shape, dtype=dtype)
    canonical = spec.dcp_view(buffer, context)
    if canonical is None:
        full = spec.full_shape_of(tuple(shape), context)
        view, shards = torch.zeros(full, dtype=dtype), ()

        def cut():
            buffer.copy_(spec.read_local(full, view.__getitem__, context))
    else:
        view, full, shards = canonical
        cut = None
    if key not in metadata:
        raise ValueError(f"the checkpoint has no entry {key!r}: it was saved from another model")
    saved = tuple(metadata[key].size)
    if saved != full:
        raise ValueError(f"{key}: the checkpoint holds shape {saved}, this model needs {full}: another model config")
    return buffer, view, _to_dcp(view, full, shards, context), cut


def _read_back(view: torch.Tensor, loaded) -> None:
    local = loaded.to_local() if hasattr(loaded, "to_local") else loaded
    if local.data_ptr() != view.data_ptr() or local.shape != view.shape:
        view.copy_(local)


def load_checkpoint(path, model, optimizer=None, scheduler=None, *, dataloader=None, scaler=None,
                    fallback: bool = False) -> dict:
    """Restore what :func:`save_checkpoint` wrote into objects built at this (possibly different) layout.

    ``path`` is the folder given to :func:`save_checkpoint` (its newest complete step is loaded, see
    ``find_checkpoint``) or one ``step-N`` folder. Build the model, shard it (same ZeRO stage or another), build
    the optimizer/scheduler/loader as for a fresh run, then call this on every rank. Returns ``{"step", "extra",
    "layout", "same_layout", "path", "skipped"}``. Raises on every rank ``FileNotFoundError`` when there is no
    complete checkpoint and ``ValueError`` for a checkpoint of another model.

    Every file is checked against the checksums recorded at save time before any state is read
    (``checkpoint_integrity``): a corrupt one raises ``CorruptCheckpointError`` naming the file, or, with
    ``fallback=True``, the next older complete step is tried instead (a warning on stderr says which and why;
    ``"skipped"`` lists ``(folder, reason)`` of the corrupt steps passed over).
    """
    path = os.fspath(path)
    inner = unwrap_model(model)
    context, plan = inner.parallel_context, getattr(inner, "parallel_plan", None)
    wait_for_checkpoint(inner)  # an asynchronous save of this model still being written
    check_arrival(context, "load_checkpoint", _RULE)
    folder, error = find_checkpoint(path), None
    if folder is None:
        error = FileNotFoundError(describe_missing(path))
    folders = agree_on_failure(context, error, what=f"load_checkpoint({path!r})", value=folder)
    if len(set(folders)) > 1:
        raise RuntimeError(f"load_checkpoint({path!r}): ranks found different checkpoints {sorted(set(folders))}; "
                           "is the folder on a file system every rank sees the same way?")
    folder, skipped = _verified(path, folder, context, fallback)
    with all_or_none(context, f"load_checkpoint({folder!r})"):
        state, pending, restored_optimizer_state, trainer_state = _load_targets(folder, inner, optimizer, context,
                                                                                plan)
    import torch.distributed.checkpoint as dcp  # here, not at import (see save_checkpoint)

    dcp.load(state, checkpoint_id=folder)
    with all_or_none(context, f"load_checkpoint({folder!r}) restoring"):
        info = _apply_loaded(folder, state, pending, restored_optimizer_state, trainer_state, optimizer, scheduler,
                             dataloader, scaler, context)
    info["skipped"] = skipped
    return info


def _verified(path: str, folder: str, context, fallback: bool) -> tuple[str, list]:
    """``(folder to load, [(corrupt folder, reason), ...])``: ``folder`` when its checksums hold, else (with
    ``fallback``) the newest older complete step whose checksums hold. Collective (agreed on every rank)."""
    skipped = []
    candidates = [folder] + (older_complete(path, folder) if fallback else [])
    for candidate in candidates:
        try:
            verify_checksums(context, candidate)
            break
        except CorruptCheckpointError as error:
            if not fallback:
                raise
            skipped.append((candidate, str(error)))
            if context.is_main_process:
                nxt = candidates[len(skipped)] if len(skipped) < len(candidates) else None
                print(f"WARNING: {error}\nWARNING: load_checkpoint: "
                      + (f"FALLING BACK to the previous complete checkpoint {nxt}" if nxt else
                         "no older complete checkpoint to fall back to"), file=sys.stderr, flush=True)
    else:
        raise CorruptCheckpointError(f"every complete checkpoint under {path} is corrupt: "
                                     + "; ".join(reason for _, reason in skipped))
    return candidate, skipped


def _load_targets(path, inner, optimizer, context, plan):
    """The DCP load plan of this rank (buffers at its local shapes) and the checks against the saved shapes."""
    trainer_state = torch.load(os.path.join(path, _TRAINER_STATE), weights_only=True)
    import torch.distributed.checkpoint as dcp  # here, not at import (see save_checkpoint)

    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if protocol_of(inner).layout == "placements":  # its DTensors go to DCP as they are
        from ..generic.checkpoint import load_targets

        return (*load_targets(path, inner, unwrap_optimizer(optimizer), metadata, _tied_aliases(inner, metadata)), {},
                trainer_state)

    state, pending = {}, []  # pending: (key, tp-local buffer, canonical view, cut(), apply(buffer))
    params = dict(inner.named_parameters())
    aliases = _tied_aliases(inner, metadata)  # another pipeline layout: a tied copy stored under its group's name
    for name, param in params.items():
        key = f"model/{aliases.get(name, name)}"
        buffer, view, state[key], cut = _target(param.shape, param.dtype, plan.shard_spec(inner, name), context, key,
                                                metadata)
        pending.append((key, buffer, view, cut, lambda b, p=param: _set_tp_local(p.data, b, context)))
    all_param_names = {name for name, _ in inner.named_parameters(remove_duplicate=False)}
    for name, buffer in inner.state_dict().items():
        if name not in all_param_names and f"model/{name}" in metadata:
            state[f"model/{name}"] = target = torch.empty_like(buffer)
            pending.append((f"model/{name}", target, target, None, lambda b, t=buffer: t.copy_(b)))

    opt = unwrap_optimizer(optimizer)
    restored_optimizer_state = {}
    if opt is not None:
        for name, param in params.items():
            if _state_holder(opt, param) is None:  # ZeRO-1: another dp rank owns this state
                continue
            prefix = f"optim/{aliases.get(name, name)}/"
            for key in (k for k in metadata if k.startswith(prefix)):
                entry = metadata[key]
                dtype = entry.properties.dtype
                if len(entry.size) == 0:
                    state[key] = buffer = torch.zeros((), dtype=dtype)
                    pending.append((key, buffer, buffer, None, None))
                else:
                    buffer, view, state[key], cut = _target(param.shape, dtype, plan.shard_spec(inner, name),
                                                            context, key, metadata)
                    pending.append((key, buffer, view, cut, None))
                restored_optimizer_state.setdefault(param, {})[key[len(prefix):]] = buffer
    return state, pending, restored_optimizer_state, trainer_state


def _apply_loaded(path, state, pending, restored_optimizer_state, trainer_state, optimizer, scheduler, dataloader,
                  scaler, context) -> dict:
    opt = unwrap_optimizer(optimizer)
    with torch.no_grad():
        for key, buffer, view, cut, apply in pending:
            _read_back(view, state[key])
            if cut is not None:
                cut()
            if apply is not None:
                apply(buffer)
        for param, entries in restored_optimizer_state.items():
            values = {}
            for state_key, buffer in entries.items():
                if buffer.dim() == 0 or not hasattr(param, "to_local"):
                    values[state_key] = buffer.to(param.device) if buffer.dim() else buffer
                else:  # FSDP2: the state is a DTensor sharded like its parameter
                    values[state_key] = torch.zeros_like(param, dtype=buffer.dtype)
                    _set_tp_local(values[state_key], buffer, context)
            _state_holder(opt, param).state[param] = values

    if opt is not None and trainer_state["param_groups"] is not None:
        if len(trainer_state["param_groups"]) != len(opt.param_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(trainer_state['param_groups'])} param groups, this "
                             f"one {len(opt.param_groups)}")
        for group, saved in zip(opt.param_groups, trainer_state["param_groups"]):
            group.update(saved)
    if scheduler is not None and trainer_state["scheduler"] is not None:
        _unwrap_scheduler(scheduler).load_state_dict(trainer_state["scheduler"])
    if dataloader is not None and trainer_state["dataloader"] is not None:
        dataloader.load_state_dict(trainer_state["dataloader"])
    if scaler is not None and trainer_state["scaler"] is not None:
        scaler.load_state_dict(trainer_state["scaler"])
    same_layout = trainer_state["layout"] == _layout(context)
    rng_file = os.path.join(path, "rng", f"rank{context.rank}.pt")
    if same_layout and os.path.isfile(rng_file):
        _restore_rng(torch.load(rng_file, weights_only=True), context)
    return {"step": trainer_state["step"], "extra": trainer_state["extra"], "layout": trainer_state["layout"],
            "same_layout": same_layout, "path": path}
