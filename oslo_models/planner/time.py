"""Predicted step time of a layout: compute, exposed communication per axis, pipeline bubble.

Hardware is three numbers per link class (``Hardware``): a matmul rate (FLOP/s), and a bandwidth (bytes/s) and a
latency (s) for links inside a node and across nodes. Defaults, stated here and printed by the CLI:

- ``cuda``: 400e12 FLOP/s (about 40% of an H100's dense bf16 peak, what large training runs sustain), NVLink
  200e9 B/s and 5e-6 s inside a node, 25e9 B/s (one 200 Gb/s NIC per GPU) and 10e-6 s across nodes;
- ``cpu``: 50e9 FLOP/s, 5e9 B/s and 50e-6 s (gloo over loopback).

``profile_matmul`` measures the rate on the device at hand (one square matmul, timed); ``measure_links``
measures bandwidth and latency with two all-reduce sizes on a live process group; ``profile.measure_collectives``
measures all-reduce, all-gather and reduce-scatter each (``Hardware.collectives``: backends differ per kind).

Compute, two ways. Default: the model's training FLOPs over the matmul rate (``ModelFacts.flops_per_token``; plus
the recomputed share under checkpointing). Profiled (``Hardware.profile``, ``--profile``; ``profile.py``): the REAL
block timed forward + backward at this rank's local shapes (tp's local widths, ``seq / cp`` tokens, the micro-batch,
the checkpointing mode) times the rank's layers, plus the embedding/head/loss timed alike, per microbatch, plus the
optimizer step (seconds per parameter byte times the rank's ZeRO-sharded parameter bytes): small local matmuls run
at a lower rate than a large square one, and norms, rotary, softmax and AdamW cost time that FLOPs ignore. In a
launched world the profile also holds blocks timed with their real process groups (``profile_parallel.py``):
where it does, an axis's communication is the grouped block minus the block alone (tp / sp / cp per microbatch;
DDP once per step, FSDP2 every microbatch), replacing the link terms below for that axis.

Collectives use the ring costs: all-reduce ``2 (g-1)/g n / B + 2 (g-1) a``; all-gather / reduce-scatter ``(g-1)/g n
/ B + (g-1) a``; point-to-point ``n / B + a``; the latency term is paid once per call, and calls are counted from
the layout: tp, per layer and microbatch, 4 all-reduces (2 forward, 2 backward) plus the embedding's and the head's,
plus the vocab-parallel loss's 3 small ones; sp, per layer 4 all-gathers and 4 reduce-scatters plus 2 of each for
the embedding and head; DDP one all-reduce per 25 MiB bucket; ZeRO-1 its broadcasts (costed as one all-gather:
issued together, waited together); FSDP2 (ZeRO-2/3) per unit (a layer, and the root) and microbatch 1 (ZeRO-2) or 2
(ZeRO-3) all-gathers and a reduce-scatter. A group uses the inter-node link when its ranks span more than one node
(mesh order ``(pp, dp, cp, tp)``, tp innermost: a group's span is its size times the product of the sizes inside
it).

Overlap rules and the overlap coefficient. Tensor-parallel and expert all-to-all collectives are on the critical
path (fully exposed). Data-parallel traffic (DDP's all-reduce once per step, FSDP2's gathers and reduce-scatter once
per microbatch) can hide behind the backward of the microbatch it follows (not under a pipeline: the runner reduces
after the schedule); the context-parallel ring behind the attention it feeds; pipeline sends are exposed once per
microbatch boundary. How much of that compute a collective really hides behind is ``Hardware.overlap``, the overlap
coefficient, MEASURED by ``profile.measure_overlap`` on the current group (a compute kernel alone, a collective
alone, both at once: ``(t_c + t_m - t_both) / min(t_c, t_m)``, as Galvatron's ``overlap_coe``): exposed =
``max(0, communication - overlap x compute)``. It is 1 (full hiding) by default, what NCCL on its own streams
approaches; gloo on a small CPU box, where the same cores run the collective and the math, measures near 0.

Bubble: from the schedule's own action list (``pipeline_bubble``): the torch schedule the runner runs gives each
pipeline rank's compute actions in order (``pipeline.plot.schedule_actions``), which are replayed with the
pipeline's data dependencies and durations in forward units of one chunk: ``F`` 1, full backward ``B`` 2, its
halves ``I`` and ``W`` 1 each (zero-bubble's split; on the first stage torch skips ``I`` and ``W`` runs the full
backward), plus what checkpointing recomputes (``3 x`` the recompute fraction, in ``B`` / ``I``). The bubble is the
busiest rank's idle time over its compute. With equal units this reproduces the closed forms (``(pp - 1) / (v m)``
for 1F1B, GPipe and interleaved, a third of it for zero-bubble); with checkpointing zero-bubble's share grows past
that third (the recomputation sits in the input-gradient pass, on the critical path of every hop).
"""
from __future__ import annotations

import time as _time
from dataclasses import dataclass, field

from ..config import ParallelConfig
from .facts import ModelFacts


@dataclass(frozen=True)
class Hardware:
    matmul_flops: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    devices_per_node: int = 8
    host_bandwidth: float = 25e9  # device <-> host (offload), bytes/s
    host_flops: float = 1e11  # the optimizer step on the host under offload, FLOP/s
    # the overlap coefficient: the share of the compute a collective can hide behind that it does hide (module
    # docstring; ``profile.measure_overlap``): 1 where collectives run on their own engine (NCCL), near 0 where
    # they share the cores (gloo on a small CPU box)
    overlap: float = 1.0
    # measured per-kind ``(kind, bandwidth, latency)`` (``profile.measure_collectives``) for groups inside a node;
    # empty: every kind uses ``intra_bandwidth`` / ``intra_latency``
    collectives: tuple = ()
    # a ``profile.ProfileTable`` (the real blocks timed at local shapes): replaces the FLOP-rate compute
    profile: object = field(default=None, compare=False, repr=False)

    @classmethod
    def default(cls, device_type: str = "cuda", devices_per_node: int = 8) -> "Hardware":
        if device_type == "cuda":
            return cls(400e12, 200e9, 5e-6, 25e9, 10e-6, devices_per_node)
        return cls(50e9, 5e9, 50e-6, 5e9, 50e-6, devices_per_node, host_bandwidth=20e9, host_flops=50e9)

    def link(self, span: int, kind: str = "all_reduce") -> tuple[float, float]:
        """``(bandwidth, latency)`` of a ``kind`` collective on a group whose ranks span ``span`` consecutive
        global ranks."""
        if span <= self.devices_per_node:
            for name, bandwidth, latency in self.collectives:
                if name == kind:
                    return bandwidth, latency
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency


def profile_matmul(device=None, size: int = 2048, dtype=None, repeats: int = 5) -> float:
    """FLOP/s of one ``size x size`` matmul on ``device`` (default: CUDA if present, else CPU), best of
    ``repeats`` after a warm-up."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = _time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, _time.perf_counter() - start)
    return 2 * size ** 3 / best


def measure_links(group=None, sizes: tuple[int, int] = (1 << 10, 1 << 22), repeats: int = 5) -> tuple[float, float]:
    """``(bandwidth, latency)`` fitted to all-reduces of two sizes (bytes) on ``group`` (collective)."""
    import torch
    import torch.distributed as dist

    g = dist.get_world_size(group)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    times = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=device)
        best = float("inf")
        for _ in range(repeats):
            dist.barrier(group=group)
            start = _time.perf_counter()
            dist.all_reduce(x, group=group)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, _time.perf_counter() - start)
        times.append(best)
    factor = 2 * (g - 1) / g
    (n0, n1), (t0, t1) = sizes, times
    bandwidth = factor * (n1 - n0) / max(t1 - t0, 1e-12)
    latency = max(0.0, (t0 - factor * n0 / bandwidth) / (2 * (g - 1)))
    return bandwidth, latency


def all_reduce(nbytes: float, g: int, link, calls: int = 1) -> float:
    """``nbytes`` reduced in ``calls`` all-reduces (the volume term is the total's; each call pays the latency)."""
    return 0.0 if g <= 1 else 2 * (g - 1) / g * nbytes / link[0] + calls * 2 * (g - 1) * link[1]


def all_gather(nbytes: float, g: int, link, calls: int = 1) -> float:
    """Also a reduce-scatter; ``nbytes``: the gathered (full) size, in ``calls`` collectives."""
    return 0.0 if g <= 1 else (g - 1) / g * nbytes / link[0] + calls * (g - 1) * link[1]


@dataclass
class TimeEstimate:
    compute: float  # forward + backward (+ recompute), and the optimizer step
    communication: dict = field(default_factory=dict)  # axis -> exposed seconds
    bubble: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + sum(self.communication.values()) + self.bubble


_RECOMPUTE = {None: 0.0, "selective": 0.1, "full": 1 / 3, "partitioned": 1 / 3, "offload": 1 / 3}
_DDP_BUCKET = 25 * 2**20  # torch DDP's default bucket: one all-reduce per bucket


def estimate_time(facts: ModelFacts, parallel: ParallelConfig, world_size: int, hardware: Hardware, *,
                  global_batch: int, seq_len: int, micro_batch: int, num_microbatches: int,
                  zero_stage: int | None = None, cpu_offload: bool = False, mixed_precision: str = "no",
                  param_bytes: int | None = None) -> TimeEstimate:
    """One optimizer step of ``global_batch`` sequences of ``seq_len`` tokens. ``num_microbatches``: pipeline
    microbatches, or gradient-accumulation steps without a pipeline; ``param_bytes``: this rank's local
    (tensor-parallel) parameter bytes, for the data-parallel traffic and the profiled optimizer step."""
    stage = parallel.zero_stage if zero_stage is None else zero_stage
    tp, pp, cp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.context_parallel_size
    ep, v = parallel.expert_parallel_size, parallel.virtual_pipeline_size
    sp = parallel.sequence_parallel and tp > 1
    dp = parallel.resolve_data_parallel_size(world_size)
    element = 2 if mixed_precision in ("bf16", "fp16") else facts.parameters()[0].element_size
    layers = facts.num_layers / pp
    mb_tokens = micro_batch * seq_len / cp  # tokens of one microbatch on one rank
    steps = num_microbatches
    h = facts.hidden_size
    dp_cp = dp * cp
    shard = parallel.data_parallel_shard_size or dp_cp
    profile = hardware.profile
    # (block, outside[, optimizer per block, optimizer outside]) timed with the real groups (profile_parallel.py)
    measured_mp = measured_dp = None
    if profile is None:  # FLOPs at one matmul rate
        tokens_per_rank = global_batch * seq_len / dp  # the replica's tokens, split over tp/cp/pp by work
        flops = facts.flops_per_token(seq_len) * tokens_per_rank / (tp * cp * pp)
        compute = flops * (1 + _RECOMPUTE[parallel.activation_checkpointing]) / hardware.matmul_flops
        optimizer = 0.0
    else:  # the real blocks timed at this rank's shapes (profile.py); the head's stage carries the outside work
        local_seq, ac = seq_len // cp, parallel.activation_checkpointing
        alone = (profile.block(tp, local_seq, micro_batch, ac), profile.outside(tp, local_seq, micro_batch))
        per_microbatch = layers * alone[0] + alone[1]
        if tp > 1 or cp > 1:
            measured_mp = profile.parallel_block(tp, sp, cp, local_seq, micro_batch, ac)
        if cp > 1 and measured_mp is None:  # the ring's attention against the other chunks' keys (the profiled
            # block saw its own chunk)
            per_microbatch += layers * 3 * 2 * seq_len * h * (1 - 1 / cp) * mb_tokens / tp / hardware.matmul_flops
        compute = steps * per_microbatch
        if dp_cp > 1 and param_bytes and pp == 1 and not cpu_offload:  # the wrapper inside the timed backward
            measured_dp = profile.parallel_block(tp, sp, cp, local_seq, micro_batch, ac, wrapper=(stage, dp_cp),
                                                 shard=parallel.data_parallel_shard_size)
        sharded = shard if stage >= 1 else 1  # ZeRO-1+ steps only this rank's shard of the parameters
        optimizer = profile.optimizer_per_byte() * (param_bytes or 0) / sharded if not cpu_offload else 0.0
        timed = measured_dp or measured_mp
        if timed is not None and len(timed) >= 4 and not cpu_offload:  # the step as timed with the groups (its
            # sharding, ZeRO-1's broadcasts, DTensor's dispatch)
            optimizer = layers * timed[2] + timed[3]
    backward = compute * 2 / 3
    hidden = hardware.overlap  # the share of the compute a collective may hide behind that it does hide

    comm: dict[str, float] = {}
    if measured_mp is not None:  # tp / sp / cp as timed: the grouped block minus the block alone
        label = "tp" if cp == 1 else "cp" if tp == 1 else "tp+cp"
        comm[label] = steps * max(0.0, layers * (measured_mp[0] - alone[0]) + measured_mp[1] - alone[1])
    if tp > 1 and measured_mp is None:
        activation = mb_tokens * h * element
        if sp:  # per layer 2 all-gathers + 2 reduce-scatters forward and as many backward; embedding and head:
            # a reduce-scatter and an all-gather each way
            n = layers * 4 + 2
            per = (all_gather(n * activation, tp, hardware.link(tp, "all_gather"), calls=n)
                   + all_gather(n * activation, tp, hardware.link(tp, "reduce_scatter"), calls=n))
        else:  # per layer 2 all-reduces forward + 2 backward; the embedding's forward, the head input's backward
            n = layers * 4 + 2
            per = all_reduce(n * activation, tp, hardware.link(tp), calls=n)
        # vocab-parallel cross-entropy: max, sum of exponentials and target logit, one float per token each
        per += all_reduce(3 * mb_tokens * 4, tp, hardware.link(tp), calls=3)
        comm["tp"] = steps * per
    if cp > 1 and measured_mp is None:  # ring: cp - 1 key/value passes forward, twice that backward, overlapping
        # attention compute
        link = hardware.link(cp * tp)
        h_kv = h * facts.num_kv_heads // facts.num_heads
        ring = 3 * (cp - 1) * (2 * mb_tokens * h_kv / tp * element / link[0] + link[1])
        # this rank's queries (mb_tokens, already 1/cp) against every key of the sequence, forward + backward
        attention = 2 * 2 * seq_len * h * layers / 2 * 3 * mb_tokens / tp / hardware.matmul_flops
        comm["cp"] = steps * max(0.0, layers * ring - hidden * attention)
    if ep > 1 and facts.num_experts:  # dispatch + combine, forward and backward
        link = hardware.link(ep * cp * tp)
        volume = mb_tokens * facts.experts_per_token * h * element / tp
        comm["ep"] = steps * layers * 4 * ((ep - 1) / ep * volume / link[0] + (ep - 1) * link[1])
    if pp > 1:  # activations forward and their gradients backward at every stage boundary of every microbatch
        link = hardware.link(dp * cp * tp + 1)  # neighbouring stages are dp x cp x tp ranks apart
        comm["pp"] = 2 * steps * v * (mb_tokens * h * element / (tp if parallel.sequence_parallel else 1)
                                      / link[0] + link[1])
    if measured_dp is not None:  # DDP / FSDP2 as timed: the wrapped block minus the unwrapped one
        base = measured_mp or alone
        wrapped = max(0.0, layers * (measured_dp[0] - base[0]) + measured_dp[1] - base[1])
        if stage <= 1:  # DDP reduces on the last microbatch only; ZeRO-1's broadcasts after the step (in the
            # timed step where the profile timed it, else the link model)
            comm["dp"] = wrapped + (all_gather(param_bytes, dp_cp, hardware.link(dp_cp * tp, "all_gather"))
                                    if stage and len(measured_dp) < 4 else 0.0)
        else:  # FSDP2 gathers and reduce-scatters every microbatch
            comm["dp"] = steps * wrapped
    elif dp_cp > 1 and param_bytes:
        span = dp_cp * tp
        if stage <= 1:  # once per step: DDP's all-reduce per bucket (it skips the accumulation steps); ZeRO-1 then
            # broadcasts every parameter from the rank that stepped it, all issued at once and waited together
            # (torch's ZeroRedundancyOptimizer): one latency per owning rank
            buckets = -(-param_bytes // _DDP_BUCKET)
            once = all_reduce(param_bytes, dp_cp, hardware.link(span), calls=buckets)
            if stage:
                once += all_gather(param_bytes, dp_cp, hardware.link(span, "all_gather"), calls=1)
            per_microbatch = 0.0
        else:  # FSDP2, one unit per layer and the root: gathers (1 at ZeRO-2, 2 at ZeRO-3) and a reduce-scatter
            units = round(layers) + 1
            gathers = 1 if stage == 2 else 2
            per_microbatch = (gathers * all_gather(param_bytes, shard, hardware.link(span, "all_gather"),
                                                   calls=units)
                              + all_gather(param_bytes, shard, hardware.link(span, "reduce_scatter"), calls=units))
            once = (all_reduce(param_bytes / shard, dp_cp // shard, hardware.link(span), calls=units)
                    if shard < dp_cp else 0.0)
        if pp > 1:  # the runner reduces after the schedule; the stage keeps parameters gathered between microbatches
            comm["dp"] = once + per_microbatch
        else:  # overlaps the backward of the microbatch it follows, as far as the overlap coefficient lets it
            last = hidden * backward / steps
            comm["dp"] = max(0.0, once - last) + steps * max(0.0, per_microbatch - last)
    if cpu_offload and param_bytes:  # parameters up and gradients down every step, and the AdamW step on the host
        host_shard = param_bytes / max(1, parallel.data_parallel_shard_size or dp_cp)
        comm["offload"] = 2 * host_shard / hardware.host_bandwidth + 12 * host_shard / element / hardware.host_flops
    bubble = 0.0
    if pp > 1:
        bubble = compute * pipeline_bubble(parallel.pipeline_schedule, pp, steps, v,
                                           _RECOMPUTE[parallel.activation_checkpointing], facts.cache)
    return TimeEstimate(compute + optimizer, comm, bubble)


def pipeline_bubble(schedule: str, pp: int, num_microbatches: int, v: int = 1, recompute: float = 0.0,
                    cache: dict | None = None) -> float:
    """Idle time over compute time of the busiest pipeline rank, from the schedule's own action list replayed
    with the pipeline's dependencies (see the module docstring; ``recompute``: the share of the forward+backward
    work checkpointing adds). Cached in ``cache`` (e.g. ``ModelFacts.cache``) by its arguments."""
    key = ("bubble", schedule, pp, num_microbatches, v, recompute)
    if cache is not None and key in cache:
        return cache[key]
    order_key = ("schedule order", schedule, pp, num_microbatches, v)
    order = cache.get(order_key) if cache is not None else None
    if order is None:  # building the torch schedule is the slow part (~0.2 s): once per shape, whatever the recompute
        from ..pipeline.plot import schedule_actions

        order = [[(a.stage_index, _KINDS[str(a.computation_type).rsplit(".", 1)[-1]], a.microbatch_index)
                  for a in row] for row in schedule_actions(schedule, pp, num_microbatches, v)]
        if cache is not None:
            cache[order_key] = order
    extra = 3 * recompute  # recomputed forward work, in forward units, done in the backward's input pass
    durations = {"F": 1.0, "B": 2.0 + extra, "I": 1.0 + extra, "W": 1.0}
    span, busy = replay(order, durations)
    ratio = span / max(busy) - 1.0
    if cache is not None:
        cache[key] = ratio
    return ratio


_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W",
          "F": "F", "B": "B", "I": "I", "W": "W"}


def replay(order: list[list[tuple[int, str, int]]], durations: dict) -> tuple[float, list[float]]:
    """``(makespan, busy time per rank)`` of per-rank actions ``(stage, kind, microbatch)`` run in order, each when
    its rank is free and its inputs exist: ``F`` after the previous stage's ``F``; ``B`` / ``I`` after this stage's
    ``F`` and the next stage's input gradient; ``W`` after this stage's ``I``. On stage 0 an ``I`` takes no time and
    its ``W`` is the full backward (torch has no input gradient to compute there)."""
    last = max(stage for row in order for stage, _, _ in row)
    done: dict = {}
    clocks, busy, cursors = [0.0] * len(order), [0.0] * len(order), [0] * len(order)
    remaining = sum(len(row) for row in order)
    while remaining:
        progressed = False
        for rank, row in enumerate(order):
            while cursors[rank] < len(row):
                stage, kind, mb = row[cursors[rank]]
                if kind == "F":
                    needs = [("F", stage - 1, mb)] if stage else []
                elif kind in ("B", "I"):
                    needs = [("F", stage, mb)] + ([("dx", stage + 1, mb)] if stage < last else [])
                else:
                    needs = [("dx", stage, mb)]
                if any(need not in done for need in needs):
                    break
                width = durations[kind]
                if stage == 0 and kind in ("I", "W"):
                    width = 0.0 if kind == "I" else durations["B"]
                end = max([clocks[rank]] + [done[need] for need in needs]) + width
                done[("F" if kind == "F" else "dx" if kind in ("B", "I") else "W", stage, mb)] = end
                clocks[rank], busy[rank] = end, busy[rank] + width
                cursors[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("a pipeline schedule's actions cannot complete (inconsistent order)")
    return max(clocks), busy
