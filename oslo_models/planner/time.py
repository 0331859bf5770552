"""Predicted step time of a layout: compute, exposed communication per axis, pipeline bubble.

Hardware is three numbers per link class (``Hardware``): a matmul rate (FLOP/s), and a bandwidth (bytes/s) and a
latency (s) for links inside a node and across nodes. Defaults, stated here and printed by the CLI:

- ``cuda``: 400e12 FLOP/s (about 40% of an H100's dense bf16 peak, what large training runs sustain), NVLink
  200e9 B/s and 5e-6 s inside a node, 25e9 B/s (one 200 Gb/s NIC per GPU) and 10e-6 s across nodes;
- ``cpu``: 50e9 FLOP/s, 5e9 B/s and 50e-6 s (gloo over loopback).

``profile_matmul`` measures the rate on the device at hand (one square matmul, timed); ``measure_links``
measures bandwidth and latency with two all-reduce sizes on a live process group.

Collectives use the ring costs: all-reduce ``2 (g-1)/g n / B + 2 (g-1) a``; all-gather / reduce-scatter
``(g-1)/g n / B + (g-1) a``; point-to-point ``n / B + a``. A group uses the inter-node link when its ranks span
more than one node (mesh order ``(pp, dp, cp, tp)``, tp innermost: a group's span is its size times the product
of the sizes inside it).

Overlap rules: tensor-parallel and expert all-to-all collectives are on the critical path (fully exposed);
data-parallel traffic (DDP's all-reduce once per step, FSDP2's gathers and reduce-scatter once per microbatch)
overlaps the backward of the microbatch it follows, so only what exceeds it is exposed (not overlapped under a
pipeline: the runner reduces after the schedule); the context-parallel ring overlaps the
attention it feeds; pipeline sends are exposed once per microbatch boundary.

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
    # the share of a block's compute its data-parallel traffic can hide behind, in the per-block model
    # (blocks.py): 1 where collectives run on their own engine (NCCL), 0 where they share the cores (gloo on a
    # small CPU box: nothing overlaps)
    overlap: float = 1.0

    @classmethod
    def default(cls, device_type: str = "cuda", devices_per_node: int = 8) -> "Hardware":
        if device_type == "cuda":
            return cls(400e12, 200e9, 5e-6, 25e9, 10e-6, devices_per_node)
        return cls(50e9, 5e9, 50e-6, 5e9, 50e-6, devices_per_node, host_bandwidth=20e9, host_flops=50e9)

    def link(self, span: int) -> tuple[float, float]:
        """``(bandwidth, latency)`` of a group whose ranks span ``span`` consecutive global ranks."""
        if span <= self.devices_per_node:
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


def all_reduce(nbytes: float, g: int, link) -> float:
    return 0.0 if g <= 1 else 2 * (g - 1) / g * nbytes / link[0] + 2 * (g - 1) * link[1]


def all_gather(nbytes: float, g: int, link) -> float:
    """Also a reduce-scatter; ``nbytes``: the gathered (full) size."""
    return 0.0 if g <= 1 else (g - 1) / g * nbytes / link[0] + (g - 1) * link[1]


@dataclass
class TimeEstimate:
    compute: float
    communication: dict = field(default_factory=dict)  # axis -> exposed seconds
    bubble: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + sum(self.communication.values()) + self.bubble


def estimate_time(facts: ModelFacts, parallel: ParallelConfig, world_size: int, hardware: Hardware, *,
                  global_batch: int, seq_len: int, micro_batch: int, num_microbatches: int,
                  zero_stage: int | None = None, cpu_offload: bool = False, mixed_precision: str = "no",
                  param_bytes: int | None = None) -> TimeEstimate:
    """One optimizer step of ``global_batch`` sequences of ``seq_len`` tokens. ``num_microbatches``: pipeline
    microbatches, or gradient-accumulation steps without a pipeline; ``param_bytes``: this rank's local
    (tensor-parallel) parameter bytes, for the data-parallel traffic."""
    stage = parallel.zero_stage if zero_stage is None else zero_stage
    tp, pp, cp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.context_parallel_size
    ep, v = parallel.expert_parallel_size, parallel.virtual_pipeline_size
    dp = parallel.resolve_data_parallel_size(world_size)
    element = 2 if mixed_precision in ("bf16", "fp16") else facts.parameters()[0].element_size
    tokens_per_rank = global_batch * seq_len / dp  # the replica's tokens, split over tp/cp/pp by work
    flops = facts.flops_per_token(seq_len) * tokens_per_rank / (tp * cp * pp)
    recompute = {None: 0.0, "selective": 0.1, "full": 1 / 3, "partitioned": 1 / 3, "offload": 1 / 3}
    flops *= 1 + recompute[parallel.activation_checkpointing]
    compute = flops / hardware.matmul_flops
    backward = compute * 2 / 3

    layers = facts.num_layers / pp
    mb_tokens = micro_batch * seq_len / cp  # tokens of one microbatch on one rank
    steps = num_microbatches
    comm: dict[str, float] = {}
    h = facts.hidden_size
    if tp > 1:  # 2 all-reduces forward + 2 backward per layer (sp: all-gather + reduce-scatter, same volume)
        link = hardware.link(tp)
        comm["tp"] = steps * layers * 4 * all_reduce(mb_tokens * h * element, tp, link)
    if cp > 1:  # ring: cp - 1 key/value passes forward, twice that backward, overlapping attention compute
        link = hardware.link(cp * tp)
        h_kv = h * facts.num_kv_heads // facts.num_heads
        ring = 3 * (cp - 1) * (2 * mb_tokens * h_kv / tp * element / link[0] + link[1])
        # this rank's queries (mb_tokens, already 1/cp) against every key of the sequence, forward + backward
        attention = 2 * 2 * seq_len * h * layers / 2 * 3 * mb_tokens / tp / hardware.matmul_flops
        comm["cp"] = steps * max(0.0, layers * ring - attention)
    if ep > 1 and facts.num_experts:  # dispatch + combine, forward and backward
        link = hardware.link(ep * cp * tp)
        volume = mb_tokens * facts.experts_per_token * h * element / tp
        comm["ep"] = steps * layers * 4 * ((ep - 1) / ep * volume / link[0] + (ep - 1) * link[1])
    if pp > 1:  # activations forward and their gradients backward at every stage boundary of every microbatch
        link = hardware.link(dp * cp * tp + 1)  # neighbouring stages are dp x cp x tp ranks apart
        comm["pp"] = 2 * steps * v * (mb_tokens * h * element / (tp if parallel.sequence_parallel else 1)
                                      / link[0] + link[1])
    dp_cp = dp * cp
    if dp_cp > 1 and param_bytes:
        link = hardware.link(dp_cp * tp)
        shard = parallel.data_parallel_shard_size or dp_cp
        if stage <= 1:  # once per step (DDP skips the accumulation steps); ZeRO-1 all-gathers the new parameters
            once = all_reduce(param_bytes, dp_cp, link) + (all_gather(param_bytes, dp_cp, link) if stage else 0.0)
            per_microbatch = 0.0
        else:  # FSDP2: gathers (1 at ZeRO-2, 2 at ZeRO-3) and a reduce-scatter per microbatch
            per_microbatch = (2 if stage == 2 else 3) * all_gather(param_bytes, shard, link)
            once = all_reduce(param_bytes / shard, dp_cp // shard, link) if shard < dp_cp else 0.0
        if pp > 1:  # the runner reduces after the schedule; the stage keeps parameters gathered between microbatches
            comm["dp"] = once + per_microbatch
        else:  # overlaps the backward of the microbatch it follows
            last = backward / steps
            comm["dp"] = max(0.0, once - last) + steps * max(0.0, per_microbatch - last)
    if cpu_offload and param_bytes:  # parameters up and gradients down every step, and the AdamW step on the host
        shard = param_bytes / max(1, parallel.data_parallel_shard_size or dp_cp)
        comm["offload"] = 2 * shard / hardware.host_bandwidth + 12 * shard / element / hardware.host_flops
    bubble = 0.0
    if pp > 1:
        bubble = compute * pipeline_bubble(parallel.pipeline_schedule, pp, steps, v,
                                           recompute[parallel.activation_checkpointing], facts.cache)
    return TimeEstimate(compute, comm, bubble)


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
