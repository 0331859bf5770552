"""Which transformer layers each pipeline stage runs, and which rank runs each stage.

A model with ``L`` layers is cut into ``S = pipeline_parallel_size * virtual_pipeline_size`` contiguous stages
(stage ``s`` runs layers ``ranges[s]``). Three ways to cut, chosen by ``ParallelConfig.pipeline_partition``:

- ``"uniform"``: ``L / S`` layers per stage; ``ValueError`` when ``S`` does not divide ``L``.
- ``"parameters"``: contiguous stages that minimize the largest stage's parameter count, counting the embeddings
  on the first stage and the output head on the last (both hold a copy of a tied embedding).
- a tuple of ``S`` positive ints: the layers per stage, given explicitly (e.g. from ``partition_by_cost`` over
  costs measured with ``measure_layer_costs``).

Stages are placed on pipeline ranks in "loop" order (stage ``s`` on rank ``s % pp``), the layout of Megatron's
interleaved schedule and of ``torch.distributed.pipelining``'s multi-stage schedules: rank ``r`` runs stages
``r, r + pp, r + 2*pp, ...``.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import nn

PARTITION_METHODS = ("uniform", "parameters")


def uniform_partition(num_layers: int, num_stages: int) -> list[range]:
    """``num_layers / num_stages`` consecutive layers per stage; ``ValueError`` when that is not an integer."""
    if num_layers % num_stages:
        raise ValueError(f"{num_layers} layers cannot be split evenly over {num_stages} pipeline stage(s) "
                         f"(pipeline_parallel_size x virtual_pipeline_size); use pipeline_partition='parameters' "
                         f"or give the layers per stage explicitly, e.g. pipeline_partition="
                         f"{tuple(_near_even(num_layers, num_stages))}")
    per_stage = num_layers // num_stages
    return [range(s * per_stage, (s + 1) * per_stage) for s in range(num_stages)]


def explicit_partition(num_layers: int, layers_per_stage: Sequence[int]) -> list[range]:
    """Stages of the given sizes, in order; ``ValueError`` unless they are positive and sum to ``num_layers``."""
    if any(count < 1 for count in layers_per_stage) or sum(layers_per_stage) != num_layers:
        raise ValueError(f"pipeline_partition={tuple(layers_per_stage)} must give every stage at least one layer "
                         f"and sum to the model's {num_layers} layers")
    ranges, start = [], 0
    for count in layers_per_stage:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def partition_by_cost(costs: Sequence[float], num_stages: int, *, first_extra: float = 0.0,
                      last_extra: float = 0.0) -> tuple[int, ...]:
    """Layers per stage for contiguous stages that minimize the most expensive stage.

    ``costs[i]`` is layer ``i``'s cost (parameters, measured seconds...); ``first_extra``/``last_extra`` are
    charged to the first/last stage (embeddings, head). Exact dynamic program, ``O(S * L^2)``.
    """
    num_layers = len(costs)
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages (each needs one layer)")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))

    def stage_cost(stage: int, start: int, stop: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[stop] - prefix[start] + extra

    inf = float("inf")
    # best[s][j]: minimal max-cost of stages 0..s covering layers 0..j-1; cut[s][j]: where stage s starts
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for j in range(1, num_layers + 1):
        best[0][j] = stage_cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, num_layers + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], stage_cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    counts, stop = [], num_layers
    for s in range(num_stages - 1, 0, -1):
        start = cut[s][stop]
        counts.append(stop - start)
        stop = start
    counts.append(stop)
    return tuple(reversed(counts))


def partition_layers(num_layers: int, num_stages: int, method="uniform", *, layer_costs: Sequence[float] = (),
                     first_extra: float = 0.0, last_extra: float = 0.0) -> list[range]:
    """The layer range of each of ``num_stages`` stages for ``method`` (see the module docstring)."""
    if num_layers < num_stages:
        raise ValueError(f"The model has {num_layers} layers, fewer than the {num_stages} pipeline stages "
                         "(pipeline_parallel_size x virtual_pipeline_size); every stage needs at least one layer")
    if isinstance(method, (tuple, list)):
        if len(method) != num_stages:
            raise ValueError(f"pipeline_partition={tuple(method)} gives {len(method)} stage(s), but the layout has "
                             f"{num_stages} (pipeline_parallel_size x virtual_pipeline_size)")
        return explicit_partition(num_layers, method)
    if method == "uniform":
        return uniform_partition(num_layers, num_stages)
    if method == "parameters":
        counts = partition_by_cost(layer_costs, num_stages, first_extra=first_extra, last_extra=last_extra)
        return explicit_partition(num_layers, counts)
    raise ValueError(f"Unknown pipeline_partition {method!r}; use one of {PARTITION_METHODS} or a tuple of "
                     "layers per stage")


def stage_to_rank(stage: int, pp_size: int) -> int:
    """Pipeline rank that runs ``stage`` (loop placement)."""
    return stage % pp_size


def stages_of_rank(pp_rank: int, pp_size: int, virtual_size: int) -> list[int]:
    """Stages run by ``pp_rank``, in execution order: ``pp_rank, pp_rank + pp, ...``."""
    return [pp_rank + chunk * pp_size for chunk in range(virtual_size)]


def measure_layer_costs(layers: Sequence[nn.Module], sample: torch.Tensor, *, repeats: int = 3,
                        call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> list[float]:
    """Seconds per layer for forward + backward on ``sample`` (``[b, s, h]``), best of ``repeats``.

    Feed the result to ``partition_by_cost`` and pass the returned counts as ``pipeline_partition``. Runs on one
    process; no communication (measure on an unsplit model or on layers of the same tensor-parallel shape).
    """
    call = call or (lambda layer, x: layer(x))
    costs = []
    for layer in layers:
        best = float("inf")
        for _ in range(repeats):
            x = sample.detach().requires_grad_(True)
            start = time.perf_counter()
            out = call(layer, x)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()
            best = min(best, time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(best)
    return costs


def _near_even(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]
