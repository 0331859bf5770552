"""``--plan auto`` and ``--global-batch-size N`` for the example scripts: the layout and the batch split chosen at
launch, for the world the script runs in.

- ``--plan auto`` runs the layout planner (``om.plan``, the same search as ``python -m oslo_models plan``) for
  ``WORLD_SIZE`` processes (torchrun / accelerate set it), the memory of one device (``--memory-per-device``, else
  the CUDA device's total memory, else host RAM divided by the processes on this node, ``LOCAL_WORLD_SIZE``) and the
  run's sequence length and mixed precision. The fastest candidate that the examples' own launch checks accept sets
  ``--tp``, ``--sequence-parallel``, ``--pp``, ``--schedule``, ``--microbatches``, ``--virtual-stages``, ``--cp``,
  ``--ep``, ``--zero``, ``--dp-shard``, ``--activation-checkpointing`` (and ``--cpu-offload`` only when it was
  allowed by passing it), and the batch: ``--batch-size`` is the candidate's micro-batch per data-parallel rank
  (with a pipeline: micro-batch x microbatches, split by the schedule) and ``--grad-accum`` its accumulation steps.
  The layout options themselves must be left at their defaults (the planner chooses them; a fixed layout is
  ``--parallel-config plan.json``).
- ``--global-batch-size N`` (sequences per optimizer step; needed by ``--plan auto``) without a plan splits ``N``
  over the given layout's data-parallel size: with a pipeline the whole replica batch is one step's batch (the
  microbatches split it), else the micro-batch is the largest divisor of the replica batch not above
  ``--batch-size`` and the accumulation takes the rest (so ``--grad-accum`` is not given with it).

Everything here runs before any process group, alike on every rank (the planner is deterministic), and a problem
is a ``UsageError``.
"""
from __future__ import annotations

import os

import torch
import transformers

import oslo_models as om
from _common import _PARALLEL_OPTIONS, UsageError, print_once, small_config
from oslo_models.planner import parse_bytes
from oslo_models.training.layout_rules import check_training_layout

# the options --plan auto sets (a value other than the parser's default is a conflict)
PLANNED = ("tp", "sequence_parallel", "tp_mode", "tp_depth", "cp", "cp_mode", "ep", "pp", "microbatches",
           "schedule", "virtual_stages", "zero", "dp_shard", "activation_checkpointing")


def check_options(args, parser) -> None:
    """At parse time: ``--plan auto`` needs ``--global-batch-size`` and no layout of its own."""
    if args.global_batch_size is not None and args.global_batch_size <= 0:
        parser.error(f"--global-batch-size must be positive, got {args.global_batch_size}")
    if args.global_batch_size is not None and args.grad_accum != parser.get_default("grad_accum"):
        parser.error("--global-batch-size sets --grad-accum: drop one of them")
    if not args.plan:
        return
    if args.parallel_config:
        parser.error("--plan auto chooses the layout: drop --parallel-config (or --plan)")
    if args.global_batch_size is None:
        parser.error("--plan auto needs --global-batch-size N (sequences per optimizer step)")
    fixed = [f"--{name.replace('_', '-')}" for name in PLANNED if getattr(args, name) != parser.get_default(name)]
    if fixed:
        parser.error(f"--plan auto chooses the layout: drop {', '.join(fixed)} (or pin a layout with "
                     f"--parallel-config plan.json)")


def device_memory(args) -> int:
    """The planner's memory cap for one process, in bytes."""
    if args.memory_per_device:
        try:
            return parse_bytes(args.memory_per_device)
        except ValueError as error:
            raise UsageError(f"--memory-per-device: {error}") from None
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local)


def plan_config(args, default_config):
    """The config the run will build (vocabulary: ``--vocab-size``, the tokenizer trained to that size)."""
    if args.model:
        return transformers.AutoConfig.from_pretrained(args.model)
    if args.model_type:
        return small_config(args, args.vocab_size)
    if default_config is None:
        raise UsageError("--plan auto in this script needs --model or --model-type (the model to plan for)")
    return default_config(args, args.vocab_size)


def apply_plan(args, auto, default_config=None, mixed_precision: str = "no") -> None:
    """``--plan auto``: plan for this launch and set the layout and batch options on ``args`` (see the module)."""
    from oslo_models.planner.search import SearchSpace

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = plan_config(args, default_config)
    model_class = auto.model_class_for(config)
    if not hasattr(model_class, "parallel_plan"):
        raise UsageError(f"--plan auto plans the native families; {config.model_type!r} trains on the generic path: "
                         f"choose its layout with the options (om.capabilities({config.model_type!r}))")
    space = SearchSpace(mixed_precision=mixed_precision, cpu_offload=(False, True) if args.cpu_offload else (False,))
    cap = device_memory(args)
    try:
        result = om.plan((model_class, config), world_size=world, memory_per_device=cap, top=50,
                         global_batch=args.global_batch_size, seq_len=args.seq_len, space=space)
    except ValueError as error:
        raise UsageError(f"--plan auto: {error}") from None
    for candidate in result.candidates:
        try:  # the examples' own rules (the planner's check is the models'; these are the training loop's)
            check_training_layout(candidate.parallel_config, cpu_offload=candidate.layout.cpu_offload,
                                  mixed_precision=mixed_precision,
                                  gradient_accumulation_steps=candidate.gradient_accumulation_steps)
        except (ValueError, NotImplementedError):
            continue
        values = candidate.parallel_config.to_dict()
        for key, option in _PARALLEL_OPTIONS.items():
            if option in PLANNED:
                setattr(args, option, values[key])
        args.cpu_offload = candidate.layout.cpu_offload
        pipelined = values["pipeline_parallel_size"] > 1
        args.batch_size = candidate.micro_batch * (candidate.num_microbatches if pipelined else 1)
        args.grad_accum = candidate.gradient_accumulation_steps
        print_once(f"--plan auto: {candidate.describe()} for {world} processes, {cap / 1e9:.3g} GB each: "
                   f"--batch-size {args.batch_size} --grad-accum {args.grad_accum}; predicted step "
                   f"{candidate.time.total:.3g} s, {candidate.memory.total / 1e9:.3g} GB per device")
        return
    smallest = result.smallest
    where = f"; the smallest any layout reaches is {smallest.memory.total / 1e9:.3g} GB" if smallest else ""
    raise UsageError(f"--plan auto: no layout of {world} processes trains this model within {cap / 1e9:.3g} GB per "
                     f"device at --global-batch-size {args.global_batch_size} --seq-len {args.seq_len}{where}: "
                     f"add processes, shorten the sequence or the batch, or allow offload (--cpu-offload)")


def split_global_batch(args, dp: int) -> None:
    """``--global-batch-size`` over a fixed layout: set ``--batch-size`` and ``--grad-accum`` (see the module)."""
    if args.global_batch_size % dp:
        raise UsageError(f"--global-batch-size {args.global_batch_size} does not split over the data-parallel size "
                         f"{dp}")
    replica = args.global_batch_size // dp
    if args.pp > 1:
        args.batch_size, args.grad_accum = replica, 1
        return
    micro = max(d for d in range(1, min(args.batch_size, replica) + 1) if replica % d == 0)
    args.batch_size, args.grad_accum = micro, replica // micro
