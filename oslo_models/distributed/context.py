"""``ParallelContext``: process groups over a named DeviceMesh, built from a ``ParallelConfig`` and the world.

Nothing here is global: every model and layer receives the context it should use, so two models with different
layouts can live in one process and tests can build contexts freely.

Mesh axes, outermost first: ``("pp", "dp", "cp", "tp")``. Tensor-parallel ranks are adjacent (global ranks
``r*tp .. r*tp+tp-1``), which keeps the chattiest group inside one node; context-parallel ranks come next (the
ring / all-to-all of every attention layer). ``dp_cp`` is ``dp`` and ``cp`` flattened: cp ranks hold the same
weights (like dp ranks), so dense gradients are reduced and ZeRO-1 shards over ``dp_cp``.

Under the 2D / 2.5D / 3D tensor-parallel modes the ``tp`` axis is itself a grid of named sub-axes (innermost
last), and ``tp`` is their flattening (same ranks, same order):

- 2D ``(q, q)``: ``("tp_col", "tp_row")``. An axis' group holds the ranks that differ only along it, so the
  ``tp_row`` group is one row of the grid (this rank's ``tp_row`` rank is its column index ``j``) and the
  ``tp_col`` group one column (rank = row index ``i``); ``tp_rank = i * q + j``.
- 2.5D ``(d, q, q)``: ``("tp_dep", "tp_col", "tp_row")``: ``d`` stacked 2D grids (Tesseract's depth).
- 3D ``(q, q, q)``: the same names, ``(z, y, x)`` of the cube (see ``parallel_layers/tensor_parallel_3d.py``).

Expert parallelism is carved out of ``dp`` (``dp x cp`` flattened, index ``d * cp + c``, under context parallelism:
cp ranks hold the same weights): data-parallel index ``d = e_dp * ep + e`` (``e`` the expert-parallel rank, adjacent
data-parallel ranks first), so each ``dp`` group is cut into ``dp/ep`` expert-parallel groups
(``ep``: the ranks that hold different experts and exchange tokens all-to-all) and ``ep`` expert-data-parallel
groups (``edp``: the ranks that hold the *same* experts, over which expert gradients are reduced). Both are extra
axes of ``ParallelContext`` (``axis("ep")``, ``axis("edp")``), built with every rank of the world taking part.
Expert tensor parallelism (``expert_tensor_parallel_size = k``) is carved out of ``tp``: ``axis("etp")`` is the
group of ``k`` consecutive tensor-parallel ranks (``tp_subgroup(k)``; Megatron-Core's expert mesh with ``etp``
innermost), over which each expert's feed-forward is split.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import ParallelConfig
from ..parallel_layers.random import RNGTracker
from ..parallel_layers.sequence_parallel import SequenceParallelRegion
from .watchdog import grace_for

MESH_AXES = ("pp", "dp", "cp", "tp")
TP_SUB_AXES = {"1d": (), "2d": ("tp_col", "tp_row"), "2.5d": ("tp_dep", "tp_col", "tp_row"),
               "3d": ("tp_dep", "tp_col", "tp_row")}
EXPERT_AXES = ("ep", "edp", "etp")  # carved out of "dp" ("etp": of "tp"; see the module docstring)


def _world_from_environment() -> tuple[int, int]:
    """(world_size, rank) of the launched job without touching any collective."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    return world, rank


ATTEMPT_ENV = "OSLO_MODELS_ELASTIC_ATTEMPT"


def init_process_group_from_environment(device_type: str | None = None, *, timeout: float | None = None) -> None:
    """Initialize the default group from torchrun's environment (NCCL on CUDA, gloo on CPU); a no-op when it is.

    ``timeout``: the backend's collective timeout in seconds (``None``: its default). Under torchrun's elastic
    agent the workers share the agent's key-value store, which outlives a restart: the keys of the previous
    attempt (gloo's peer addresses, barrier counters) would be read by the next one, which then connects to dead
    ranks. Each attempt therefore gets its own key prefix, which every rank must agree on (:func:`_attempt`)."""
    if dist.is_initialized():
        return
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if key not in os.environ]
    if missing:
        raise ValueError(f"torch.distributed is not initialized and the environment lacks {missing}; "
                         "launch with torchrun / accelerate launch, or call torch.distributed.init_process_group")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=kwargs.get("timeout", timedelta(minutes=30)))
        attempt = _attempt(store, rank)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"oslo_models/attempt{attempt}", store),
                                rank=rank, world_size=world, **kwargs)
    else:
        dist.init_process_group(backend=backend, **kwargs)


def _attempt(store, rank: int) -> int:
    """This job's attempt number under torchrun's elastic agents, the same on every rank.

    ``TORCHELASTIC_RESTART_COUNT`` alone is not: with several nodes, an agent whose workers were still healthy when
    another node's failed restarts them as a *membership change*, which torchrun does not count (its count stays
    behind). Each rank therefore also counts its own starts in the agent's store (``add`` on a per-rank key, which
    outlives restarts): exact unless this rank died before reaching here in an earlier attempt. The larger of the
    two is wrong only if both are (a rank that died during start-up on a node that was restarted uncounted).
    Recorded in this process's environment as ``OSLO_MODELS_ELASTIC_ATTEMPT`` for the watchdog's keys."""
    starts = store.add(f"oslo_models/starts/rank{rank}", 1)
    attempt = max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0), starts - 1)
    os.environ[ATTEMPT_ENV] = str(attempt)
    return attempt


def elastic_attempt() -> int:
    """The attempt number agreed at :func:`init_process_group_from_environment` (torchrun's restart count when the
    group was started otherwise)."""
    return int(os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


@dataclass(frozen=True)
class AxisInfo:
    """One mesh axis seen from this rank: its group (``None`` when the axis has one rank), size and rank."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    ranks: tuple[int, ...]  # global ranks of this rank's group, in axis order


class ParallelContext:
    """Process groups for one parallel layout, seen from the calling rank.

    Build with ``ParallelContext.from_config(cfg)``. Attributes used by layers:

    - ``tp_group``/``tp_size``/``tp_rank`` (and ``dp_*``, ``pp_*``): ``group`` is ``None`` when the axis has size
      one, which every layer treats as "no communication", so the same layer runs single-process.
    - ``sequence_parallel``: Megatron sequence parallelism over the tensor-parallel group.
    - ``device``: where this rank's parameters live (``cuda:LOCAL_RANK`` with NCCL, ``cpu`` with gloo).
    - ``rng``: the ``RNGTracker`` that gives dropout inside split regions a per-rank stream.
    - ``mesh``: the ``DeviceMesh`` (``None`` single-process), for FSDP2/DTensor users.
    """

    def __init__(self, config: ParallelConfig, *, world_size: int, rank: int, device: torch.device,
                 mesh=None, axes: dict[str, AxisInfo]):
        self.config = config
        self.world_size = world_size
        self.rank = rank
        self.device = device
        self.mesh = mesh
        self._axes = axes
        # whether the forward now running is sequence-parallel: set by the model's stack, read by the TP layers
        self.sequence_parallel_region = SequenceParallelRegion()
        self.rng = RNGTracker(config.seed, tp_rank=axes["tp"].rank, tp_size=axes["tp"].size, pp_rank=axes["pp"].rank,
                              device=device)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: ParallelConfig | None = None, *, device_type: str | None = None
                    ) -> "ParallelContext":
        """Validate ``config`` against the launched world, initialize torch.distributed if needed, build the mesh.

        The world-size check runs before any collective, so a wrong launch is a ``ValueError``, never a hang.
        """
        config = config or ParallelConfig()
        if not isinstance(config, ParallelConfig):
            raise ValueError(f"parallel= must be a ParallelConfig, got {type(config).__name__}")
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        world_size, rank = _world_from_environment()
        data_parallel_size = config.resolve_data_parallel_size(world_size)  # raises ValueError on mismatch
        sizes = {"pp": config.pipeline_parallel_size, "dp": data_parallel_size, "cp": config.context_parallel_size,
                 "tp": config.tensor_parallel_size}
        sub_axes = TP_SUB_AXES[config.tensor_parallel_mode]
        sizes.update(zip(sub_axes, config.grid_shape))

        if world_size == 1 and not dist.is_initialized():
            # Single process, not launched by torchrun: no process group is needed for anything.
            return cls.single_process(config, device=torch.device(device_type))

        if not dist.is_initialized():
            init_process_group_from_environment(device_type, timeout=config.collective_timeout and (
                config.collective_timeout + grace_for(config.collective_timeout)))
        if device_type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")

        from torch.distributed.device_mesh import init_device_mesh

        dims = MESH_AXES[:-1] + (sub_axes or ("tp",))
        mesh = init_device_mesh(device_type, tuple(sizes[name] for name in dims), mesh_dim_names=dims)
        flat = {}
        if sub_axes:  # "tp" = the grid flattened, so everything that uses the tensor-parallel group keeps working
            flat["tp"] = mesh[sub_axes]._flatten("tp")
        axes = {}
        for name in MESH_AXES + sub_axes:
            sub = flat[name] if name in flat else mesh[name]
            ranks = tuple(int(r) for r in sub.mesh.flatten().tolist())
            group = sub.get_group() if sizes[name] > 1 else None
            axes[name] = AxisInfo(group, sizes[name], sub.get_local_rank(), ranks)
        if sizes["cp"] > 1:  # the gradient-reduction group of dense parameters: dp and cp flattened
            sub = mesh[("dp", "cp")]._flatten("dp_cp")
            axes["dp_cp"] = AxisInfo(sub.get_group(), sizes["dp"] * sizes["cp"], sub.get_local_rank(),
                                     tuple(int(r) for r in sub.mesh.flatten().tolist()))
        else:
            axes["dp_cp"] = axes["dp"]
        grid = mesh.mesh.reshape(sizes["pp"], sizes["dp"] * sizes["cp"], sizes["tp"])  # tp sub-axes flattened
        axes.update(_expert_axes(grid, rank, config.expert_parallel_size, axes["dp"]))
        if config.context_parallel_mode == "hybrid" and sizes["cp"] > 1:
            axes.update(_hybrid_context_axes(mesh.mesh.reshape(sizes["pp"], sizes["dp"], sizes["cp"], -1), rank,
                                             config.context_parallel_all_to_all_size))
        context = cls(config, world_size=world_size, rank=rank, device=device, mesh=mesh, axes=axes)
        etp = config.expert_tensor_parallel_size
        start = axes["tp"].rank // etp * etp
        axes["etp"] = AxisInfo(context.tp_subgroup(etp), etp, axes["tp"].rank % etp,
                               axes["tp"].ranks[start:start + etp])
        if config.collective_timeout is not None:
            # a peer that stops participating: a clear error naming group, op and missing ranks (watchdog.py)
            from .watchdog import ensure_watchdog

            watchdog = ensure_watchdog(rank, world_size, config.collective_timeout)
            for name, axis in axes.items():
                watchdog.watch_group(axis.group, name)
        return context

    @classmethod
    def single_process(cls, config: ParallelConfig | None = None, *, device=None) -> "ParallelContext":
        """A context of one rank and no process group, whatever was launched (every axis has size 1). Used to
        build a model's plain (unsplit) twin on the meta device, e.g. to count a layer's parameters, without any
        collective."""
        config = config or ParallelConfig()
        sub_axes = TP_SUB_AXES[config.tensor_parallel_mode]
        axes = {name: AxisInfo(None, 1, 0, (0,)) for name in MESH_AXES + sub_axes + EXPERT_AXES + ("dp_cp",)}
        return cls(config, world_size=1, rank=0, device=torch.device(device or "cpu"), axes=axes)

    # ------------------------------------------------------------------ accessors
    def axis(self, name: str) -> AxisInfo:
        if name not in self._axes:
            raise ValueError(f"Unknown mesh axis {name!r}; axes are {tuple(self._axes)}")
        return self._axes[name]

    @property
    def tensor_parallel_mode(self) -> str:
        return self.config.tensor_parallel_mode

    @property
    def is_grid(self) -> bool:
        """A grid tensor-parallel mode (2D / 2.5D / 3D), even with one rank."""
        return self.config.tensor_parallel_mode != "1d"

    @property
    def tp_group(self):
        return self._axes["tp"].group

    @property
    def tp_size(self) -> int:
        return self._axes["tp"].size

    @property
    def tp_rank(self) -> int:
        return self._axes["tp"].rank

    @property
    def dp_group(self):
        return self._axes["dp"].group

    @property
    def dp_size(self) -> int:
        return self._axes["dp"].size

    @property
    def dp_rank(self) -> int:
        return self._axes["dp"].rank

    @property
    def pp_group(self):
        return self._axes["pp"].group

    @property
    def pp_size(self) -> int:
        return self._axes["pp"].size

    @property
    def pp_rank(self) -> int:
        return self._axes["pp"].rank

    @property
    def cp_group(self):
        """Context-parallel group: the ranks holding the chunks of the same sequences (``None`` at cp=1)."""
        return self._axes["cp"].group

    @property
    def cp_size(self) -> int:
        return self._axes["cp"].size

    @property
    def cp_rank(self) -> int:
        return self._axes["cp"].rank

    @property
    def dp_cp_group(self):
        """Where dense gradients are reduced (and ZeRO shards): dp x cp flattened, the dp group at cp=1."""
        return self._axes["dp_cp"].group

    @property
    def dp_cp_size(self) -> int:
        return self._axes["dp_cp"].size

    @property
    def ep_group(self):
        return self._axes["ep"].group

    @property
    def ep_size(self) -> int:
        return self._axes["ep"].size

    @property
    def ep_rank(self) -> int:
        return self._axes["ep"].rank

    @property
    def edp_group(self):
        """Expert-data-parallel group: the dp ranks holding the same experts (the dp group itself at ep=1)."""
        return self._axes["edp"].group

    @property
    def edp_size(self) -> int:
        return self._axes["edp"].size

    @property
    def edp_rank(self) -> int:
        return self._axes["edp"].rank

    @property
    def etp_group(self):
        """Expert-tensor-parallel group: the ``expert_tensor_parallel_size`` consecutive tp ranks splitting each
        expert (``None`` at one rank)."""
        return self._axes["etp"].group

    @property
    def etp_size(self) -> int:
        return self._axes["etp"].size

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel and self.tp_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def tp_subgroup(self, size: int):
        """The group of ``size`` consecutive tensor-parallel ranks that holds this rank (``None`` for one rank).

        Used where a tensor is replicated on a few TP ranks only (GQA key/value heads at ``tp > num_key_value_heads``,
        ``parallel_layers/kv_heads.py``). Collective the first time a size is asked for: every rank of the world
        creates every such group, in the same order (models do so while applying their plan on every rank); the
        groups are kept on this context.
        """
        if size == 1 or self.tp_size == 1:
            return None
        if self.tp_size % size:
            raise ValueError(f"tensor_parallel_size={self.tp_size} cannot be cut into groups of {size} ranks")
        if size == self.tp_size:
            return self.tp_group
        groups = self.__dict__.setdefault("_tp_subgroups", {})
        if size not in groups:
            rows = self.mesh.mesh.reshape(-1, self.tp_size)  # one row of global ranks per tp group
            mine = None
            for row in rows:
                for start in range(0, self.tp_size, size):
                    ranks = [int(r) for r in row[start:start + size].tolist()]
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = group
            groups[size] = mine
            if self.config.collective_timeout is not None:
                from .watchdog import current_watchdog

                watchdog = current_watchdog()
                if watchdog is not None:
                    watchdog.watch_group(mine, f"tp[{size}]")
        return groups[size]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def __repr__(self) -> str:
        return (f"ParallelContext(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"dp={self.dp_rank}/{self.dp_size}, cp={self.cp_rank}/{self.cp_size}, "
                f"ep={self.ep_rank}/{self.ep_size}, "
                f"pp={self.pp_rank}/{self.pp_size}, "
                f"sequence_parallel={self.sequence_parallel}, device={self.device})")


def _hybrid_context_axes(mesh: torch.Tensor, rank: int, inner: int) -> dict[str, AxisInfo]:
    """``context_parallel_mode="hybrid"``: the ``cp_a2a`` axis (``inner`` consecutive cp ranks: the all-to-all
    group) and the ``cp_ring`` axis (the ranks at the same place of every such group: the ring) of ``rank`` in the
    ``[pp, dp, cp, tp]`` rank grid ``mesh``. Every rank creates every group in the same order (collective)."""
    pp_size, dp_size, cp_size, tp_size = mesh.shape
    found = {}
    for axis, blocks in (("cp_a2a", [list(range(g * inner, (g + 1) * inner)) for g in range(cp_size // inner)]),
                         ("cp_ring", [list(range(i, cp_size, inner)) for i in range(inner)])):
        for pp in range(pp_size):
            for dp in range(dp_size):
                for tp in range(tp_size):
                    for members in blocks:
                        ranks = tuple(int(mesh[pp, dp, c, tp]) for c in members)
                        group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
                        if rank in ranks:
                            found[axis] = AxisInfo(group, len(ranks), ranks.index(rank), ranks)
    return found


def _expert_axes(mesh: torch.Tensor, rank: int, ep: int, dp_axis: AxisInfo) -> dict[str, AxisInfo]:
    """The ``ep`` and ``edp`` axes of ``rank`` in the ``[pp, dp x cp, tp]`` rank grid ``mesh``.

    At ``ep == 1`` no group is created: ``ep`` is trivial and ``edp`` is the ``dp`` axis. Otherwise every rank
    creates every group in the same order (``dist.new_group`` is collective over the world).
    """
    if ep == 1:
        return {"ep": AxisInfo(None, 1, 0, (rank,)), "edp": dp_axis}
    pp_size, dp_size, tp_size = mesh.shape
    found = {}
    for axis, members in (("ep", lambda b: [b * ep + e for e in range(ep)]),
                          ("edp", lambda e: list(range(e, dp_size, ep)))):
        for pp in range(pp_size):
            for tp in range(tp_size):
                for block in range(dp_size // ep if axis == "ep" else ep):
                    ranks = tuple(int(mesh[pp, d, tp]) for d in members(block))
                    group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
                    if rank in ranks:
                        found[axis] = AxisInfo(group, len(ranks), ranks.index(rank), ranks)
    return found
