"""``python -m oslo_models plan``: print the ranked layouts and write the best ``ParallelConfig`` as JSON.

    python -m oslo_models plan --model path/or/config.json --world-size 16 --memory-per-device 80GB \\
        --global-batch 512 --seq-len 4096 [--devices-per-node 8] [--profile] [--top 10] [--json plan.json]
        [--per-block]   # also per-block plans: ParallelConfig.block_plan (planner/blocks.py)

``--profile`` times the model's real blocks on this machine's device at each candidate's local shapes
(``planner/profile.py``) instead of counting FLOPs; under ``torchrun`` (every rank runs the same command; rank 0
prints and writes) it also times the blocks with the process groups the launched world can host
(``planner/profile_parallel.py``), and measures the overlap coefficient and the collectives' costs on the world
group.

The JSON file is exactly ``ParallelConfig.to_json`` of the best layout (``ParallelConfig.from_json`` reads it);
the training options a ParallelConfig does not hold (micro-batch size, gradient accumulation, mixed precision) are
printed under the table, and all candidates go to ``--report report.json`` if asked.
"""
from __future__ import annotations

import argparse
import json

GB = 1e9


def add_parser(commands, formatter_class) -> None:
    plan = commands.add_parser("plan", help="rank parallel layouts by predicted step time under a memory cap",
                               formatter_class=formatter_class, description=__doc__.split("\n\n")[0])
    plan.add_argument("--model", required=True, help="model folder or its config.json (no weights are read)")
    plan.add_argument("--world-size", type=int, required=True, help="devices (processes) to plan for")
    plan.add_argument("--memory-per-device", required=True, help="memory cap per device, e.g. 80GB or 80GiB")
    plan.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    plan.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    plan.add_argument("--devices-per-node", type=int, default=8, help="devices sharing the fast intra-node link")
    plan.add_argument("--nodes", type=int, help="nodes (sets --devices-per-node to world-size / nodes)")
    plan.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default rates of this device type")
    plan.add_argument("--profile", action="store_true",
                      help="time the model's real blocks at each layout's local shapes on this machine's device "
                           "(and the matmul rate) instead of counting FLOPs")
    plan.add_argument("--profile-repeats", type=int, default=5, help="timed runs per profiled shape (best kept)")
    plan.add_argument("--offload", action="store_true", help="also consider CPU offload (ZeRO-2/3)")
    plan.add_argument("--per-block", action="store_true",
                      help="also plan per block (ZeRO 'auto': shard/replicate, reshard, checkpoint each block)")
    plan.add_argument("--mixed-precision", choices=("bf16", "no"), default="bf16", help="Accelerate's setting")
    plan.add_argument("--top", type=int, default=10, help="rows to print")
    plan.add_argument("--json", help="write the best layout's ParallelConfig here")
    plan.add_argument("--report", help="write every printed candidate (memory and time split) here")
    plan.set_defaults(handler=run)


def format_table(candidates) -> str:
    head = (f"{'#':>2}  {'layout':<58} {'mem GB':>7} {'(par/grad/opt/act/buf)':>28} {'step s':>8} "
            f"{'(compute/comm/bubble)':>24} {'tok/s':>10}")
    lines = [head, "-" * len(head)]
    for i, c in enumerate(candidates, 1):
        m, t = c.memory, c.time
        split = "/".join(f"{x / GB:.1f}" for x in (m.parameters, m.gradients, m.optimizer, m.activations, m.buffers))
        comm = sum(t.communication.values())
        lines.append(f"{i:>2}  {c.describe():<58} {m.total / GB:>7.2f} {split:>28} {t.total:>8.3f} "
                     f"{f'{t.compute:.3f}/{comm:.3f}/{t.bubble:.3f}':>24} {c.tokens_per_second:>10.0f}")
    return "\n".join(lines)


def _join_launched_world(args) -> int:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1), join the process group so ``--profile`` times blocks with their
    groups, the overlap and the collectives (``profile.profiled_hardware``); this rank's number."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0
    if not dist.is_initialized():
        import torch

        from ..distributed.context import init_process_group_from_environment

        init_process_group_from_environment("cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu")
    return dist.get_rank()


def run(args: argparse.Namespace) -> int:
    from . import parse_bytes, plan
    from .search import SearchSpace
    from .time import Hardware

    per_node = args.devices_per_node
    if args.nodes:
        if args.world_size % args.nodes:
            raise ValueError(f"--nodes {args.nodes} does not divide --world-size {args.world_size}")
        per_node = args.world_size // args.nodes
    hardware = Hardware.default(args.device, per_node)
    space = SearchSpace(cpu_offload=(False, True) if args.offload else (False,),
                        mixed_precision=args.mixed_precision, per_block=args.per_block)
    cap = parse_bytes(args.memory_per_device)
    rank = _join_launched_world(args) if args.profile else 0
    result = plan(args.model, world_size=args.world_size, memory_per_device=cap, global_batch=args.global_batch,
                  seq_len=args.seq_len, top=args.top, hardware=hardware, space=space, profile=args.profile,
                  profile_repeats=args.profile_repeats)
    if rank:  # every rank profiled (collectives) and planned alike; one prints and writes
        return 0
    hardware = result.hardware
    print(f"hardware: {hardware.matmul_flops:.3g} FLOP/s, intra-node {hardware.intra_bandwidth:.3g} B/s "
          f"{hardware.intra_latency:.1e} s, inter-node {hardware.inter_bandwidth:.3g} B/s "
          f"{hardware.inter_latency:.1e} s, {per_node} devices per node, overlap {hardware.overlap:g}")
    if hardware.profile is not None:
        table = hardware.profile
        print(f"profiled: {len(table.blocks)} block shapes and {len(table.outsides)} embedding/head shapes timed "
              f"(forward + backward), optimizer {table.optimizer:.3g} s per parameter byte"
              + (f"; {len(table.parallel)} timed with their process groups" if table.parallel else "")
              + "".join(f"; {note}" for note in table.notes))
    print(f"{result.considered} accepted layouts evaluated; refused by the composition check: "
          f"{sum(result.refused.values())}")
    if not result.candidates:
        smallest = result.smallest
        where = (f"; the smallest any layout reaches is {smallest.memory.total / GB:.2f} GB "
                 f"({smallest.describe()})" if smallest else "")
        print(f"no layout fits {cap / GB:.2f} GB per device{where}: add devices, shorten the sequence or the "
              f"batch, or allow CPU offload (--offload)")
        return 1
    print(format_table(result.candidates))
    best = result.candidates[0]
    print(f"best: {best.describe()}: micro-batch {best.micro_batch}, gradient accumulation "
          f"{best.gradient_accumulation_steps}, mixed_precision={best.layout.mixed_precision}"
          + (", cpu_offload=True" if best.layout.cpu_offload else ""))
    if args.json:
        best.parallel_config.to_json(args.json)
        print(f"wrote {args.json}")
    if args.report:
        with open(args.report, "w", encoding="utf-8") as handle:
            json.dump([c.to_dict() for c in result.candidates], handle, indent=2)
    return 0
