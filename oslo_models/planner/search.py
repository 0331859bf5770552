"""Enumerate layouts for a world size, keep those the composition check accepts and that fit the memory cap, rank
them by predicted step time.

The space (``SearchSpace``): 1D tensor parallelism (with or without sequence parallelism), pipeline parallelism
(uniform partitions only: ``pp x v`` must divide the layers) with its schedules and microbatch counts, context
parallelism (the sequence must split into ``2 cp`` chunks), expert parallelism (mixture-of-experts models), data
parallelism with ZeRO 0-3, HSDP shard groups, CPU offload (opt-in), activation checkpointing modes, and without a
pipeline the micro-batch size (gradient accumulation takes the rest of the batch). Every candidate goes through
``composition.refusal`` - the one validation the project has - and is dropped with its reason kept.

``search`` is exact with pruning: a candidate whose compute + bubble alone (a lower bound of its time) is no better
than the ``top``-th best found so far is skipped, as is a parallel shape whose most sharded training state alone
exceeds the cap; training states and refusals are computed once per shape. ``brute_force`` evaluates every
candidate in full, with none of that; tests check the two agree.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..composition import Layout, refusal
from ..config import ParallelConfig
from .facts import ModelFacts
from .memory import MemoryEstimate, estimate_memory, training_state
from .time import Hardware, TimeEstimate, estimate_time


@dataclass(frozen=True)
class SearchSpace:
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    checkpointing: tuple[str | None, ...] = (None, "selective", "full")
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b", "zero_bubble")
    sequence_parallel: tuple[bool, ...] = (False, True)
    cpu_offload: tuple[bool, ...] = (False,)
    hsdp: bool = True
    context_parallel: bool = True
    max_microbatches: int = 64
    mixed_precision: str = "bf16"
    per_block: bool = False  # also per-block plans (ParallelConfig.block_plan; blocks.py): zero_stage="auto"


@dataclass
class Candidate:
    layout: Layout
    micro_batch: int
    num_microbatches: int  # pipeline microbatches, or gradient-accumulation steps without a pipeline
    memory: MemoryEstimate
    time: TimeEstimate
    global_batch: int
    seq_len: int

    @property
    def parallel_config(self) -> ParallelConfig:
        return self.layout.parallel_config()

    @property
    def tokens_per_second(self) -> float:
        return self.global_batch * self.seq_len / self.time.total

    @property
    def gradient_accumulation_steps(self) -> int:
        return 1 if self.layout.parallel.get("pipeline_parallel_size", 1) > 1 else self.num_microbatches

    def describe(self) -> str:
        extra = (f"m{self.num_microbatches}" if self.layout.parallel.get("pipeline_parallel_size", 1) > 1
                 else f"mbs{self.micro_batch} x acc{self.num_microbatches}")
        schedule = self.layout.parallel.get("pipeline_schedule")
        shard = self.layout.parallel.get("data_parallel_shard_size")
        v = self.layout.parallel.get("virtual_pipeline_size", 1)
        schedule = f"{schedule}, v{v}" if v > 1 else schedule
        plan = self.layout.parallel.get("block_plan")
        if plan:
            from ..block_plan import describe_plan

            schedule = f"blocks {describe_plan(plan)}"
        return (self.layout.describe() + (f" hsdp{shard}" if shard else "") + (f" ({schedule})" if schedule else "")
                + f" {extra}")

    def sort_key(self) -> tuple:
        return (self.time.total, self.memory.total, self.describe())

    def to_dict(self) -> dict:
        return {"layout": self.describe(), "parallel_config": self.parallel_config.to_dict(),
                "cpu_offload": self.layout.cpu_offload, "mixed_precision": self.layout.mixed_precision,
                "micro_batch": self.micro_batch, "num_microbatches": self.num_microbatches,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "memory": {k: getattr(self.memory, k) for k in ("parameters", "gradients", "optimizer",
                                                                 "activations", "buffers", "host", "total")},
                "time": {"compute": self.time.compute, "communication": dict(self.time.communication),
                         "bubble": self.time.bubble, "total": self.time.total},
                "tokens_per_second": self.tokens_per_second}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parallel_shapes(facts: ModelFacts, world_size: int, space: SearchSpace, seq_len: int):
    """``(tp, pp, cp, dp, ep)`` over the world (before any option or check)."""
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            if pp > facts.num_layers:
                continue
            for cp in _divisors(world_size // (tp * pp)) if space.context_parallel else (1,):
                if seq_len % (2 * cp) and cp > 1:
                    continue
                dp = world_size // (tp * pp * cp)
                for ep in (_divisors(dp) if facts.num_experts else (1,)):
                    if facts.num_experts and facts.num_experts % ep:
                        continue
                    yield tp, pp, cp, dp, ep


def _options(facts: ModelFacts, shape, space: SearchSpace, global_batch: int):
    """Every ``(parallel options, zero_stage, cpu_offload, micro_batch, num_microbatches)`` of one shape."""
    tp, pp, cp, dp, ep = shape
    if global_batch % dp:
        return
    per_replica = global_batch // dp
    base = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp, data_parallel_size=dp)
    if ep > 1:
        base["expert_parallel_size"] = ep
    pipelines = [dict()]
    if pp > 1:
        pipelines = []
        for schedule in space.schedules:
            for v in ((2,) if schedule == "interleaved_1f1b" else (1, 2) if schedule == "zero_bubble" else (1,)):
                if facts.num_layers % (pp * v):
                    continue
                for m in _divisors(per_replica):
                    if m < pp or m > space.max_microbatches:
                        continue
                    options = dict(pipeline_schedule=schedule, num_microbatches=m)
                    if v > 1:
                        options["virtual_pipeline_size"] = v
                    pipelines.append(options)
    shards = [None]
    for sp in (space.sequence_parallel if tp > 1 else (False,)):
        for ckpt in space.checkpointing:
            for pipeline in pipelines:
                for stage in space.zero_stages:
                    if stage and dp * cp == 1:
                        continue  # nothing to shard: the same layout as stage 0
                    for offload in space.cpu_offload:
                        if offload and stage < 2:
                            continue
                        if space.hsdp and stage >= 2 and cp == 1 and ep == 1:
                            shards = [None] + [k for k in _divisors(dp) if 1 < k < dp]
                        else:
                            shards = [None]
                        for shard in shards:
                            parallel = dict(base, **pipeline)
                            if sp:
                                parallel["sequence_parallel"] = True
                            if ckpt:
                                parallel["activation_checkpointing"] = ckpt
                            if shard:
                                parallel["data_parallel_shard_size"] = shard
                            layout = Layout(parallel=parallel, zero_stage=stage, cpu_offload=offload,
                                            mixed_precision=space.mixed_precision, moe=ep > 1)
                            if pp > 1:
                                m = pipeline["num_microbatches"]
                                yield layout, per_replica // m, m
                            else:
                                for mbs in _divisors(per_replica):
                                    yield layout, mbs, per_replica // mbs


def evaluate(facts: ModelFacts, layout: Layout, world_size: int, hardware: Hardware, *, micro_batch: int,
             num_microbatches: int, global_batch: int, seq_len: int) -> Candidate:
    """Memory and time of one layout (no check)."""
    parallel = layout.parallel_config()
    memory = estimate_memory(facts, parallel, world_size, cpu_offload=layout.cpu_offload, micro_batch=micro_batch,
                             seq_len=seq_len, num_microbatches=num_microbatches,
                             mixed_precision=layout.mixed_precision)
    local = training_state(facts, parallel, world_size, zero_stage=0).parameters
    time = estimate_time(facts, parallel, world_size, hardware, global_batch=global_batch, seq_len=seq_len,
                         micro_batch=micro_batch, num_microbatches=num_microbatches,
                         cpu_offload=layout.cpu_offload, mixed_precision=layout.mixed_precision, param_bytes=local)
    return Candidate(layout, micro_batch, num_microbatches, memory, time, global_batch, seq_len)


@dataclass
class SearchResult:
    candidates: list[Candidate]  # fitting, fastest first
    considered: int = 0
    refused: dict = field(default_factory=dict)  # reason -> count
    smallest: Candidate | None = None  # the layout with the least memory (reported when nothing fits)
    hardware: Hardware | None = None  # what the times were predicted with (measured figures under profiling)


def brute_force(facts: ModelFacts, world_size: int, *, memory_cap: float, global_batch: int, seq_len: int,
                hardware: Hardware, space: SearchSpace = SearchSpace(), top: int = 10) -> SearchResult:
    """Every candidate checked and evaluated in full, then sorted: the reference ``search`` is tested against."""
    result, fitting = SearchResult([], hardware=hardware), []
    for shape in parallel_shapes(facts, world_size, space, seq_len):
        for layout, mbs, m in _options(facts, shape, space, global_batch):
            if refusal(layout, facts.model_class, facts.config) is not None:
                continue
            result.considered += 1
            candidate = evaluate(facts, layout, world_size, hardware, micro_batch=mbs, num_microbatches=m,
                                 global_batch=global_batch, seq_len=seq_len)
            if candidate.memory.total <= memory_cap:
                fitting.append(candidate)
    for candidate in per_block_candidates(facts, world_size, memory_cap=memory_cap, global_batch=global_batch,
                                          seq_len=seq_len, hardware=hardware, space=space):
        result.considered += 1
        fitting.append(candidate)
    result.candidates = sorted(fitting, key=Candidate.sort_key)[:top]
    return result


def per_block_candidates(facts: ModelFacts, world_size: int, *, memory_cap: float, global_batch: int, seq_len: int,
                         hardware: Hardware, space: SearchSpace):
    """With ``space.per_block``: for every ``tp x dp`` shape (no pp, cp, ep: what ``block_plan`` composes with),
    sequence parallelism on/off and micro-batch size, the fastest per-block plan under the cap
    (``blocks.best_plan``, exact), as a ``Candidate`` with ``zero_stage=3`` and its ``block_plan``."""
    if not space.per_block or 3 not in space.zero_stages:
        return
    from .blocks import best_plan, block_costs, evaluate_plan

    for tp in _divisors(world_size):
        dp = world_size // tp
        if dp == 1 or global_batch % dp:
            continue
        for sp in (space.sequence_parallel if tp > 1 else (False,)):
            base = dict(tensor_parallel_size=tp, data_parallel_size=dp, **({"sequence_parallel": True} if sp else {}))
            probe = Layout(parallel=base, zero_stage=3, mixed_precision=space.mixed_precision)
            if refusal(probe, facts.model_class, facts.config) is not None:
                continue
            for mbs in _divisors(global_batch // dp):
                costs = block_costs(facts, world_size, hardware, tensor_parallel_size=tp, sequence_parallel=sp,
                                    global_batch=global_batch, seq_len=seq_len, micro_batch=mbs,
                                    mixed_precision=space.mixed_precision)
                plan = best_plan(costs, memory_cap)
                if plan is None:
                    continue
                memory, time = evaluate_plan(costs, plan)
                layout = Layout(parallel=dict(base, block_plan=plan), zero_stage=3,
                                mixed_precision=space.mixed_precision)
                yield Candidate(layout, mbs, global_batch // dp // mbs, memory, time, global_batch, seq_len)


def search(facts: ModelFacts, world_size: int, *, memory_cap: float, global_batch: int, seq_len: int,
           hardware: Hardware, space: SearchSpace = SearchSpace(), top: int = 10) -> SearchResult:
    """The ``top`` fastest layouts under ``memory_cap`` bytes per device (exact; see the module docstring)."""
    result = SearchResult([], hardware=hardware)
    heap: list = []  # (-time, -memory, reverse description) of the best ``top``: heap[0] is the worst kept
    refusals: dict = {}
    for shape in parallel_shapes(facts, world_size, space, seq_len):
        floor = None
        for layout, mbs, m in _options(facts, shape, space, global_batch):
            key = layout.key()
            if key not in refusals:
                refusals[key] = refusal(layout, facts.model_class, facts.config)
                if refusals[key] is not None:
                    reason = refusals[key].split(";")[0][:120]
                    result.refused[reason] = result.refused.get(reason, 0) + 1
            if refusals[key] is not None:
                continue
            if floor is None:  # the most sharded state this shape reaches: over the cap -> the whole shape is out
                floor = _state_floor(facts, layout, world_size, space)
                if floor > memory_cap:
                    break
            if len(heap) == top and _time_floor(facts, layout, world_size, hardware, mbs, m, global_batch,
                                                seq_len) > -heap[0][0]:
                continue  # even with no communication it is slower than the top-th kept
            result.considered += 1
            candidate = evaluate(facts, layout, world_size, hardware, micro_batch=mbs, num_microbatches=m,
                                 global_batch=global_batch, seq_len=seq_len)
            if result.smallest is None or candidate.memory.total < result.smallest.memory.total:
                result.smallest = candidate
            if candidate.memory.total > memory_cap:
                continue
            entry = (-candidate.time.total, -candidate.memory.total, _Reverse(candidate.describe()), candidate)
            if len(heap) < top:
                heapq.heappush(heap, entry)
            elif entry[:3] > heap[0][:3]:
                heapq.heapreplace(heap, entry)
    for candidate in per_block_candidates(facts, world_size, memory_cap=memory_cap, global_batch=global_batch,
                                          seq_len=seq_len, hardware=hardware, space=space):
        result.considered += 1
        entry = (-candidate.time.total, -candidate.memory.total, _Reverse(candidate.describe()), candidate)
        if len(heap) < top:
            heapq.heappush(heap, entry)
        elif entry[:3] > heap[0][:3]:
            heapq.heapreplace(heap, entry)
    result.candidates = sorted((entry[3] for entry in heap), key=Candidate.sort_key)
    if not result.candidates:  # nothing fits: find the least memory any accepted layout reaches, in full
        everything = brute_force(facts, world_size, memory_cap=float("inf"), global_batch=global_batch,
                                 seq_len=seq_len, hardware=hardware, space=space, top=10**9)
        result.smallest = min(everything.candidates, key=lambda c: (c.memory.total, c.describe()), default=None)
    return result


def _state_floor(facts: ModelFacts, layout: Layout, world_size: int, space: SearchSpace) -> float:
    """The least device memory of the training state any stage of the space gives this shape (0 with offload)."""
    if any(space.cpu_offload):
        return 0.0
    parallel = layout.parallel_config()
    return min(max(training_state(facts, parallel, world_size, zero_stage=stage, pp_rank=r).total
                   for r in _pp_ranks(parallel)) for stage in space.zero_stages)


def _pp_ranks(parallel: ParallelConfig) -> list[int]:
    pp = parallel.pipeline_parallel_size
    return sorted({0, min(1, pp - 1), pp - 1})


def _time_floor(facts, layout, world_size, hardware, mbs, m, global_batch, seq_len) -> float:
    """Compute + bubble of a candidate: its time with every communication term zero (a lower bound)."""
    time = estimate_time(facts, layout.parallel_config(), world_size, hardware, global_batch=global_batch,
                         seq_len=seq_len, micro_batch=mbs, num_microbatches=m, mixed_precision=layout.mixed_precision)
    return time.compute + time.bubble


class _Reverse:
    """A string ordered backwards (so the heap of negated keys keeps ``sort_key``'s tie-break)."""

    def __init__(self, text: str):
        self.text = text

    def __lt__(self, other):
        return self.text > other.text

    def __eq__(self, other):
        return self.text == other.text
