"""The layout planner: the fastest layout under a memory cap, from the model's own structure and a cost model.

    import oslo_models as om
    result = om.plan("path/to/model", world_size=16, memory_per_device="80GB", global_batch=512, seq_len=4096)
    best = result.candidates[0]
    best.parallel_config.to_json("plan.json")   # om.ParallelConfig.from_json("plan.json") reads it

``facts.py`` reads the model (meta device), ``memory.py`` counts each rank's bytes, ``time.py`` predicts the step
time (``profile.py`` times the real blocks for it under ``profile=True``), ``search.py`` enumerates, checks
(``composition.refusal``) and ranks; ``cli.py`` is ``python -m oslo_models plan``.
"""
from __future__ import annotations

import importlib
import re

# names -> submodule, imported on first use: ``python -m oslo_models --help`` builds the ``plan`` parser from
# ``planner/cli.py`` without importing torch. (The search itself is ``planner.search.search``: a package attribute
# of that name is the submodule once it is imported.)
_LAZY = {"ModelFacts": ".facts", "MemoryEstimate": ".memory", "estimate_memory": ".memory",
         "training_state": ".memory", "Candidate": ".search", "SearchResult": ".search", "SearchSpace": ".search",
         "brute_force": ".search", "Hardware": ".time", "TimeEstimate": ".time",
         "estimate_time": ".time", "measure_links": ".time", "profile_matmul": ".time",
         "ProfileTable": ".profile", "Profiler": ".profile", "measure_overlap": ".profile",
         "measure_collectives": ".profile", "profiled_hardware": ".profile"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


__all__ = ["Candidate", "Hardware", "MemoryEstimate", "ModelFacts", "ProfileTable", "Profiler", "SearchResult",
           "SearchSpace", "TimeEstimate", "brute_force", "estimate_memory", "estimate_time", "measure_collectives",
           "measure_links", "measure_overlap", "parse_bytes", "plan", "profile_matmul", "profiled_hardware",
           "training_state"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value) -> int:
    """``80GB`` (10**9), ``80GiB`` (2**30), ``1.5e9`` or an int -> bytes; ``ValueError`` otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read a memory size from {value!r}; write e.g. 80GB or 80GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def plan(model, *, world_size: int, memory_per_device, global_batch: int, seq_len: int, top: int = 10,
         hardware=None, devices_per_node: int = 8, profile: bool = False, profile_repeats: int = 5, space=None,
         task: str | None = None):
    """Ranked layouts for training ``model`` on ``world_size`` devices.

    Args:
        model: a model folder or ``config.json`` path, a ``ModelFacts``, or ``(model_class, config)``.
        memory_per_device: the cap, bytes or a string (``"80GB"``).
        global_batch, seq_len: sequences per optimizer step and tokens per sequence.
        hardware: rates and links (default ``Hardware.default``: CUDA figures when CUDA is present, else CPU);
            ``profile=True`` measures this machine (``profile.profiled_hardware``): the real blocks timed at each
            candidate's local shapes replace the FLOP-rate compute, and with a process group up the overlap
            coefficient and the collectives' costs are measured on it. The shapes the search asked for are then timed
            again ``profile_repeats`` times round-robin (``Profiler.refine``) and the search is run again on them.
    Returns a ``SearchResult``: ``candidates`` fastest first (empty when nothing fits; then ``smallest`` is the
    accepted layout with the least memory).
    """
    from .facts import ModelFacts
    from .search import SearchSpace, search
    from .time import Hardware

    if isinstance(model, ModelFacts):
        facts = model
    elif isinstance(model, tuple):
        facts = ModelFacts(*model)
    else:
        facts = ModelFacts.from_pretrained_config(model, task=task)
    if hardware is None:
        import torch

        hardware = Hardware.default("cuda" if torch.cuda.is_available() else "cpu", devices_per_node)
    if profile:
        from .profile import profiled_hardware

        hardware = profiled_hardware(facts, hardware, repeats=profile_repeats)
    kw = dict(memory_cap=parse_bytes(memory_per_device), global_batch=global_batch, seq_len=seq_len,
              hardware=hardware, space=space or SearchSpace(), top=top)
    if profile:  # the lazily timed shapes were timed one after the other: again round-robin, then rank on that
        search(facts, world_size, **kw)
        hardware.profile.refine(profile_repeats)
    return search(facts, world_size, **kw)
