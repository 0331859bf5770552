"""``--profile``: the real model's pieces timed on the device at hand, for the local shapes of each candidate
(issue 31; Galvatron's approach: profile, then model).

What is timed (forward + backward, best of ``repeats`` after a warm-up, on one process):

- ``block(tp, seq, micro_batch, checkpointing)``: one decoder block of the REAL model class at this rank's local
  shapes: ``micro_batch`` sequences of ``seq`` tokens (``seq_len / cp`` under context parallelism) and the tensor-
  parallel local widths. The model is built from a copy of the config with ``heads / tp`` attention heads,
  ``max(1, kv_heads / tp)`` key/value heads (few kv heads are replicated, as the sharding does), ``intermediate /
  tp`` and ``vocab / tp``, the head width kept (``head_dim``), and NO process group: every matmul, norm, rotary,
  softmax and activation runs at exactly the shapes a tp rank runs, which a matmul-only timing would miss (the
  norms, rotary and softmax are a large share of a small model's block on CPU). The alternative - a real tp group -
  would time the collectives too, which the time model counts separately from measured link costs. The built block's
  parameter count is checked against the sharding's own local shapes (``ParamFact.local_shape``); a family whose
  config cannot express the local widths (e.g. a head width derived from ``hidden / heads``) falls back to the
  ``tp = 1`` block divided by ``tp``, and says so in ``notes``. The block's time is the difference of a three-layer
  and a one-layer model, halved (same shapes, interleaved runs), so whatever the stack does around its blocks (masks,
  position embeddings) is charged once, to
- ``outside(tp, seq, micro_batch)``: the one-layer model minus its block: embedding, final norm, head, loss;
- ``optimizer_per_byte()``: ``torch.optim.AdamW``'s step over the one-layer model's parameters, seconds per
  parameter byte (the optimizer step of a rank is this times its local, ZeRO-sharded, parameter bytes).

In a launched world (``groups=True``), the keys the world can host are also timed WITH their process groups
(``profile_parallel.py``: tp / sp / cp collectives, the ring attention's own kernels, DDP's and FSDP2's gathers,
reductions and bookkeeping inside the timed backward); ``time.py`` then charges the grouped block minus the block
alone as that axis's communication. Not profiled: expert parallelism (a mixture-of-experts block is timed with every
expert local; ep's all-to-alls are ``time.py``'s), and, where the world cannot host a group (e.g. one node planning
many), that axis: the link model stands in (for cp: the other chunks' attention at the matmul rate).

Sequence parallelism does not change a block's local matmul shapes (only its norms run on ``1 / tp`` of the
tokens), so it is not part of the key: its cost is the collectives it adds, counted by ``time.py``. Checkpointing
modes ``partitioned`` and ``offload`` recompute what ``full`` does and are timed as ``full``.

Every figure is cached under its key (``table``), so a search over hundreds of layouts times a handful of shapes;
``ProfileTable`` holds fixed figures (a saved table, or a hand-written one in tests) and raises ``KeyError`` on a
key it lacks.
"""
from __future__ import annotations

import copy
import time as _time

import torch

_EXTRA = 2  # the block's time: (a 1 + _EXTRA layer model - a 1-layer one) / _EXTRA (the noise divided)
_FULL = {"full": "full", "partitioned": "full", "offload": "full", "selective": "selective", None: None}


def block_key(tp: int, seq: int, micro_batch: int, checkpointing: str | None) -> str:
    return f"tp{tp} s{seq} b{micro_batch} ac{_FULL[checkpointing]}"


def outside_key(tp: int, seq: int, micro_batch: int) -> str:
    return f"tp{tp} s{seq} b{micro_batch}"


class ProfileTable:
    """Fixed measured figures: ``blocks`` and ``outsides`` map ``block_key`` / ``outside_key`` to seconds of one
    forward + backward, ``optimizer`` is seconds per parameter byte of the optimizer step."""

    def __init__(self, blocks: dict | None = None, outsides: dict | None = None, optimizer: float = 0.0,
                 notes: list | None = None, parallel: dict | None = None):
        self.blocks, self.outsides = dict(blocks or {}), dict(outsides or {})
        self.optimizer, self.notes = optimizer, list(notes or [])
        # profile_parallel.parallel_key -> [block, outside] seconds timed with the process groups (profile_parallel.py)
        self.parallel = {k: list(v) for k, v in (parallel or {}).items()}

    def block(self, tp: int, seq: int, micro_batch: int, checkpointing: str | None = None) -> float:
        key = block_key(tp, seq, micro_batch, checkpointing)
        if key not in self.blocks:
            self._measure(tp, seq, micro_batch, checkpointing)
        return self.blocks[key]

    def outside(self, tp: int, seq: int, micro_batch: int) -> float:
        key = outside_key(tp, seq, micro_batch)
        if key not in self.outsides:
            self._measure(tp, seq, micro_batch, None)
        return self.outsides[key]

    def optimizer_per_byte(self) -> float:
        return self.optimizer

    def parallel_block(self, tp: int, sp: bool, cp: int, seq: int, micro_batch: int, checkpointing: str | None = None,
                       wrapper: tuple[int, int] | None = None, shard: int | None = None) -> tuple | None:
        """``(block, outside, optimizer per block, optimizer outside)`` seconds: one forward + backward, and the
        optimizer step, timed with the real process groups of ``tp`` (and sequence parallelism) and ``cp`` ranks,
        and with ``wrapper = (zero stage, dp x cp)`` the data-parallel wrapper and its sharded optimizer too
        (``profile_parallel.py``); ``None`` where none was timed (the link model stands in)."""
        from .profile_parallel import parallel_key

        key = parallel_key(tp, sp, cp, seq, micro_batch, checkpointing, wrapper)
        if key in self.parallel:
            return tuple(self.parallel[key])
        return self._measure_parallel(tp, sp, cp, seq, micro_batch, checkpointing, wrapper, shard)

    def _measure_parallel(self, *arguments) -> tuple | None:
        return None

    def _measure(self, tp, seq, micro_batch, checkpointing):
        raise KeyError(f"no profiled figure for {block_key(tp, seq, micro_batch, checkpointing)} in this table")

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "outsides": self.outsides, "optimizer": self.optimizer, "notes": self.notes,
                "parallel": self.parallel}

    @classmethod
    def from_dict(cls, values: dict) -> "ProfileTable":
        return cls(values["blocks"], values["outsides"], values["optimizer"], values.get("notes"),
                   values.get("parallel"))


class Profiler(ProfileTable):
    """A ``ProfileTable`` that measures a missing key on first use (module docstring; ``refine`` times them all
    again, round-robin), on ``device`` (default: CUDA if present, else CPU; CUDA runs under bf16 autocast, what
    mixed-precision training runs). ``groups=True`` (a launched world of more than one rank): ``parallel_block``
    keys the world can host are timed with their real process groups (``profile_parallel.py``; collective)."""

    def __init__(self, facts, device=None, repeats: int = 5, groups: bool = False):
        super().__init__()
        self.facts, self.repeats = facts, repeats
        self._models: dict = {}  # (tp, layers, checkpointing) -> the model, reused over sequence and batch sizes
        self._runs: dict = {}  # (tp, seq, micro_batch, mode) -> (local tp, [best 1-layer, best 3-layer seconds])
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if groups:
            from .profile_parallel import ParallelRuns

            groups = ParallelRuns(self)
        self.groups = groups or None

    def _measure_parallel(self, *arguments) -> tuple | None:
        return None if self.groups is None else self.groups.measure(*arguments)

    # ------------------------------------------------------------------ models at local shapes
    def _local_config(self, tp: int, layers: int, seq: int):
        facts, config = self.facts, copy.deepcopy(self.facts.config)
        heads, kv = facts.num_heads, facts.num_kv_heads
        _set(config, ("num_hidden_layers", "n_layer", "num_layers"), layers)
        if tp > 1:
            if getattr(config, "head_dim", None) is None and hasattr(config, "head_dim"):
                config.head_dim = facts.hidden_size // heads
            _set(config, ("num_attention_heads", "n_head", "num_heads"), heads // tp)
            _set(config, ("num_key_value_heads",), max(1, kv // tp))
            _set(config, ("intermediate_size", "n_inner", "d_ff"), -(-facts.intermediate_size // tp))
            _set(config, ("vocab_size",), -(-facts.vocab_size // tp))
        for name in ("max_position_embeddings", "n_positions"):
            if getattr(config, name, None) is not None and getattr(config, name) < seq:
                setattr(config, name, seq)
        return config

    def _build(self, tp: int, layers: int, seq: int, checkpointing):
        key = (tp, layers, checkpointing)
        model = self._models.get(key)
        if model is None or _positions(model.config) < seq:
            torch.manual_seed(0)
            # a one-process context with no group: even inside a launched world the block runs alone here
            model = self.facts.model_class(self._local_config(tp, layers, seq),
                                           parallel_context=_alone(self.device)).to(self.device).train()
            if checkpointing:
                model.set_activation_checkpointing(checkpointing)
            self._models[key] = model
        return model

    def _local_widths_hold(self, model, tp: int) -> bool:
        """The built block has the parameters one tp rank holds of a block (the sharding's own arithmetic)."""
        from ..pipeline.adapter import adapter_for

        whole, facts = self.facts._whole()
        path, index = adapter_for(whole).layer_ids(whole)[0]
        prefix = f"{path}.{index}."
        expected = sum(_numel(f.local_shape(tp=tp)) for f in facts if f.name.startswith(prefix))
        built = sum(p.numel() for name, p in model.named_parameters() if name.startswith(prefix))
        return expected == built

    def _autocast(self):
        return torch.autocast("cuda", torch.bfloat16) if self.device.type == "cuda" else _Null()

    def _run(self, model, batch):
        with self._autocast():
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    def _time(self, models, batch) -> list[float]:
        """Best seconds of one forward + backward of each model, runs interleaved (load drifts alike)."""
        best = [float("inf")] * len(models)
        for round_ in range(self.repeats + 2):
            for i, model in enumerate(models):
                self._sync()
                start = _time.perf_counter()
                self._run(model, batch)
                self._sync()
                if round_ > 1:  # rounds 0 and 1 warm up (allocator, lazily built kernels)
                    best[i] = min(best[i], _time.perf_counter() - start)
        return best

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _measure(self, tp, seq, micro_batch, checkpointing):
        mode = _FULL[checkpointing]
        local_tp = tp
        one = self._build(tp, 1, seq, None)
        if tp > 1 and not self._local_widths_hold(one, tp):
            self.notes.append(f"{type(one).__name__}: the config cannot express tp={tp}'s local widths; "
                              f"the tp=1 block divided by {tp} stands for it")
            local_tp, one = 1, self._build(1, 1, seq, None)
        more = self._build(local_tp, 1 + _EXTRA, seq, mode)
        one = self._build(local_tp, 1, seq, mode)
        times = self._time([one, more], self._batch(one, micro_batch, seq))
        self._runs[(tp, seq, micro_batch, mode)] = (local_tp, times)
        self._record(tp, seq, micro_batch, mode)
        if not self.optimizer:
            self.optimizer = self._optimizer(one)

    def _batch(self, model, micro_batch: int, seq: int) -> dict:
        vocab = model.config.vocab_size  # the local (vocab-parallel) share: the ids a tp rank's embedding serves
        ids = torch.randint(1, vocab, (micro_batch, seq), generator=torch.Generator().manual_seed(1))
        ids = ids.to(self.device)
        return {"input_ids": ids, "labels": ids}

    def _record(self, tp, seq, micro_batch, mode) -> None:
        local_tp, (t1, t_more) = self._runs[(tp, seq, micro_batch, mode)]
        block = max(t_more - t1, 1e-9) / _EXTRA / (tp // local_tp)
        self.blocks[block_key(tp, seq, micro_batch, mode)] = block
        if mode is None:
            self.outsides[outside_key(tp, seq, micro_batch)] = max(t1 - block * (tp // local_tp), 0.0)

    def combine(self, reduce) -> None:
        """Replace every shape's raw best times by ``reduce(times)`` (a flat list in a fixed shape order, e.g. the
        least over the ranks of a world that profiled at once: an all-reduce MIN) and derive the figures again.
        The raw times are combined, not the derived differences (a block is a difference of two runs)."""
        shapes = sorted(self._runs, key=str)
        runs = self.groups.runs if self.groups is not None else {}
        keys = sorted(runs)
        flat = list(reduce([t for shape in shapes for t in self._runs[shape][1]]
                           + [t for k in keys for t in runs[k][1]]))
        for shape in shapes:
            self._runs[shape] = (self._runs[shape][0], [flat.pop(0) for _ in self._runs[shape][1]])
            self._record(*shape)
        for key in keys:
            runs[key] = (runs[key][0], [flat.pop(0) for _ in runs[key][1]])
            self.groups.record(key)

    def refine(self, rounds: int = 5) -> None:
        """Time every shape measured so far again, ``rounds`` times, round-robin over the shapes (a machine whose
        load drifts then disturbs every shape alike, as the lazily measured ones were timed one after the other);
        each model keeps its best time."""
        for _ in range(rounds):
            for (tp, seq, micro_batch, mode), (local_tp, best) in self._runs.items():
                models = [self._build(local_tp, 1, seq, mode), self._build(local_tp, 1 + _EXTRA, seq, mode)]
                batch = self._batch(models[0], micro_batch, seq)
                for i, model in enumerate(models):
                    self._sync()
                    start = _time.perf_counter()
                    self._run(model, batch)
                    self._sync()
                    best[i] = min(best[i], _time.perf_counter() - start)
            if self.groups is not None:
                self.groups.refine(1)
        for shape in self._runs:
            self._record(*shape)

    def _optimizer(self, model) -> float:
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters() if p.requires_grad]
        for p in params:  # copies: the timed models keep their weights
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        best = float("inf")
        for round_ in range(self.repeats + 1):
            self._sync()
            start = _time.perf_counter()
            optimizer.step()
            self._sync()
            if round_:
                best = min(best, _time.perf_counter() - start)
        return best / sum(p.numel() * p.element_size() for p in params)


def measure_overlap(group=None, repeats: int = 8, nbytes: int = 1 << 24) -> float:
    """The share of a collective that runs hidden behind compute on this device and ``group`` (collective): an
    all-reduce of ``nbytes`` alone (``t_m``), a compute kernel alone sized to last about as long (``t_c``: matmuls,
    so neither can hide the other merely by being short) and both at once (the all-reduce launched asynchronously,
    the compute run, then waited: ``t_both``); ``(t_c + t_m - t_both) / min(t_c, t_m)``, clipped to ``[0, 1]``: 1
    when they run side by side, 0 when one after the other (Galvatron's ``overlap_coe`` measures the same
    contention as a slowdown factor). Every rank gets the least value any rank saw."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    x = torch.zeros(nbytes // 4, device=device)
    a = torch.randn(256, 256, device=device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(body) -> float:
        best = float("inf")
        for _ in range(repeats + 1):
            dist.barrier(group=group)
            sync()
            start = _time.perf_counter()
            body()
            sync()
            best = min(best, _time.perf_counter() - start)
        return best

    t_m = timed(lambda: dist.all_reduce(x, group=group))
    one = timed(lambda: a @ a)
    count = torch.tensor([max(1, round(t_m / max(one, 1e-9)))], dtype=torch.float64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)  # the same kernel on every rank
    count = int(count)

    def compute():
        for _ in range(count):
            a @ a

    def both():
        work = dist.all_reduce(x, group=group, async_op=True)
        compute()
        work.wait()

    t_c = timed(compute)
    t_both = timed(both)
    hidden = (t_c + t_m - t_both) / max(min(t_c, t_m), 1e-12)
    value = torch.tensor([min(1.0, max(0.0, hidden))])
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return float(value)


def measure_collectives(group=None, sizes: tuple[int, int] = (1 << 10, 1 << 22),
                        repeats: int = 5) -> tuple[tuple[str, float, float], ...]:
    """``(kind, bandwidth, latency)`` of ``all_reduce``, ``all_gather`` and ``reduce_scatter`` on ``group``, each
    fitted to two sizes (bytes of the full tensor) with its own ring cost (``time.py``) (collective). Backends differ
    per kind (gloo's reduce-scatter is not a ring), so each is measured, not derived from the all-reduce."""
    import torch.distributed as dist

    g = dist.get_world_size(group)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    out = []
    for kind, factor, calls in (("all_reduce", 2 * (g - 1) / g, 2 * (g - 1)), ("all_gather", (g - 1) / g, g - 1),
                                ("reduce_scatter", (g - 1) / g, g - 1)):
        times = []
        for nbytes in sizes:
            full = torch.zeros(nbytes // 4 // g * g, device=device)
            shard = torch.zeros(full.numel() // g, device=device)
            best = float("inf")
            for _ in range(repeats):
                dist.barrier(group=group)
                start = _time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(full, group=group)
                elif kind == "all_gather":
                    dist.all_gather_into_tensor(full, shard, group=group)
                else:
                    dist.reduce_scatter_tensor(shard, full, group=group)
                if device == "cuda":
                    torch.cuda.synchronize()
                best = min(best, _time.perf_counter() - start)
            times.append(best)
        (n0, n1), (t0, t1) = sizes, times
        bandwidth = factor * (n1 - n0) / max(t1 - t0, 1e-12)
        latency = max(0.0, (t0 - factor * n0 / bandwidth) / calls)
        out.append((kind, bandwidth, latency))
    return tuple(out)


def profiled_hardware(facts, hardware, *, device=None, repeats: int = 5):
    """``hardware`` with the measured figures of this machine: the matmul rate (``time.profile_matmul``), a
    ``Profiler`` of ``facts`` (blocks timed lazily, per shape, as the search asks) and, when a process group is
    up, the blocks timed with the groups the world can host (``profile_parallel.py``), the overlap coefficient and
    the per-kind collective costs on the world group (collective: every rank calls it). Without a process group
    ``overlap`` and the links stay as given (printed by the CLI)."""
    import dataclasses

    import torch.distributed as dist

    from .time import profile_matmul

    launched = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    changes = dict(matmul_flops=profile_matmul(device), profile=Profiler(facts, device, repeats, groups=launched))
    if launched:
        collectives = measure_collectives()
        _, bandwidth, latency = collectives[0]
        changes.update(overlap=measure_overlap(), collectives=collectives, intra_bandwidth=bandwidth,
                       intra_latency=latency)
    return dataclasses.replace(hardware, **changes)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _alone(device):
    """A ``ParallelContext`` of one rank with no process group on ``device`` (every axis of size 1)."""
    from ..config import ParallelConfig
    from ..distributed.context import EXPERT_AXES, MESH_AXES, AxisInfo, ParallelContext

    axes = {name: AxisInfo(None, 1, 0, (0,)) for name in MESH_AXES + EXPERT_AXES + ("dp_cp",)}
    return ParallelContext(ParallelConfig(), world_size=1, rank=0, device=device, axes=axes)


def _positions(config) -> int:
    for name in ("max_position_embeddings", "n_positions"):
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    return 1 << 30


def _set(config, names, value) -> None:
    for name in names:
        if getattr(config, name, None) is not None:
            setattr(config, name, value)
            return


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
