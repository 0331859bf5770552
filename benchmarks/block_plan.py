"""A per-block plan (``ParallelConfig.block_plan``, chosen by ``planner.blocks.best_plan``) against plain ZeRO-3 and
plain ZeRO-0 at the same memory cap, on 2 gloo CPU processes (issue 31).

    python benchmarks/block_plan.py [--steps 4] [--json benchmarks/block_plan.json]

What runs. A small Llama (hidden 512, 8 layers, 8 heads, 4 key/value heads, intermediate 1408, vocab 2048: 25.5M
parameters, fp32, AdamW), global batch 4 x 128 tokens, dp=2. In one spawned world of 2 processes:

1. calibration: the matmul rate (``planner_ranking.measured_matmul``) and gloo's bandwidth/latency
   (``planner.time.measure_links``), with ``Hardware.overlap=0`` (gloo's collectives run on the same two cores
   as the compute: nothing hides behind anything);
2. the cap: halfway between the per-block model's predicted memory of all blocks sharded and kept gathered
   (ZeRO-2-like) and all sharded and resharded (ZeRO-3-like), so plain ZeRO-0 is far over it (its prediction is
   printed too, and the uniform model's ``planner.memory.estimate_memory``); ``best_plan`` picks the plan under it;
3. each of ZeRO-0 (DDP), ZeRO-3 (FSDP2) and the plan is built (``LlamaForCausalLM.from_config``, the same seed),
   wrapped by ``training.shard_data_parallel``, stepped once (warm-up: AdamW's state exists from here), then the
   peak RSS is reset (``/proc/self/clear_refs``: 5) and ``--steps`` timed steps run (barrier to barrier). Each
   layout runs in fresh processes (an earlier layout's freed pages would stay in the RSS).

Memory: **peak RSS** of each rank during the timed steps (``VmHWM`` after the reset; the larger rank), minus the
RSS of the fresh process before its model was built (``baseline``: torch, the interpreter, gloo): what the
layout's tensors added. The processes run with ``MALLOC_MMAP_THRESHOLD_=65536`` (every tensor of 64 KiB or more is
its own mapping, unmapped when freed) and ``malloc_trim`` runs before the baseline and the reset, so the RSS
follows live memory; it still counts small allocations and fragmentation, so it is an upper bound of the tensors.
tokens/s: global tokens per step over the fastest timed step (the least disturbed by other jobs on the shared
machine; the median is kept in the JSON).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GLOBAL_BATCH, SEQ = 4, 128
CONFIG = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=1408, vocab_size=2048, max_position_embeddings=SEQ)


def _rss(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so the RSS counts live memory."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> None:
    _trim()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _run(name: str, options: dict, config, steps: int, baseline: int) -> dict:
    """Build, wrap, one warm-up step, reset the peak RSS, ``steps`` timed steps; the row (same on every rank)."""
    import torch.distributed as dist

    import oslo_models as om
    from oslo_models import training

    torch.manual_seed(0)
    model = om.LlamaForCausalLM.from_config(config, parallel=om.ParallelConfig(**options)).train()
    context = model.parallel_context
    model, optimizer = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(1, config.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = ids[context.dp_rank::context.dp_size].contiguous()
    batch = {"input_ids": rows, "labels": rows}
    times = []
    for step in range(steps + 1):
        if step == 1:
            gc.collect()
            _reset_peak()
        dist.barrier()
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if step:
            times.append(time.perf_counter() - start)
    peak = torch.tensor([_rss("VmHWM") - baseline], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del model, optimizer
    gc.collect()
    return {"layout": name, "options": options,
            "step_times": times, "best": min(times), "median": statistics.median(times),
            "tokens_per_second": GLOBAL_BATCH * SEQ / min(times), "peak_rss_minus_baseline": int(peak)}


def _calibrate(out: str) -> None:
    """Rank 0 writes the calibrated hardware, the cap, the plan and the predictions to ``out`` (collective)."""
    import torch.distributed as dist
    import transformers

    import oslo_models as om
    from benchmarks.planner_ranking import calibrate_world
    from oslo_models.planner.blocks import BLOCK_OPTIONS, best_plan, block_costs, evaluate_plan
    from oslo_models.planner.facts import ModelFacts
    from oslo_models.planner.memory import estimate_memory
    from oslo_models.planner.time import Hardware

    world, matmul, bandwidth, latency = calibrate_world()
    config = transformers.LlamaConfig(**CONFIG)
    hardware = Hardware(matmul, bandwidth, latency, bandwidth, latency, devices_per_node=world, overlap=0.0)
    facts = ModelFacts(om.LlamaForCausalLM, config)
    costs = block_costs(facts, world, hardware, global_batch=GLOBAL_BATCH, seq_len=SEQ,
                        micro_batch=GLOBAL_BATCH // world)
    uniform = {name: evaluate_plan(costs, (BLOCK_OPTIONS[j],) * costs.blocks)
               for name, j in (("zero0", 4), ("zero2", 2), ("zero3", 0))}  # R, s, S without checkpointing
    # between all-kept-gathered (ZeRO-2-like) and all-resharded (ZeRO-3-like): ZeRO-0 is far over it
    cap = (uniform["zero2"][0].total + uniform["zero3"][0].total) / 2
    plan = best_plan(costs, cap)
    chosen = evaluate_plan(costs, plan)
    predicted = {name: {"memory": m.total, "time": t.total} for name, (m, t) in uniform.items()}
    predicted["blocks"] = {"memory": chosen[0].total, "time": chosen[1].total}
    for stage in (0, 3):
        predicted[f"zero{stage}"]["uniform_memory"] = estimate_memory(
            facts, om.ParallelConfig(data_parallel_size=world, zero_stage=stage), world,
            micro_batch=GLOBAL_BATCH // world, seq_len=SEQ, device="cpu").total
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump({"matmul_flops": matmul, "bandwidth": bandwidth, "latency": latency, "cap": cap,
                       "plan": [vars(choice) for choice in plan], "predicted": predicted}, handle)


def _measure(out: str, name: str, options: dict, steps: int) -> None:
    """One layout in fresh processes (so no earlier layout's freed pages sit in the RSS); rank 0 writes the row."""
    import torch.distributed as dist
    import transformers

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    gc.collect()
    _trim()
    baseline = _rss("VmRSS")
    row = _run(name, options, transformers.LlamaConfig(**CONFIG), steps, baseline)
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump({**row, "baseline_rss": baseline}, handle)


def main() -> None:
    import tempfile

    import oslo_models as om
    from tests.helpers.dist import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per layout (after one warm-up step)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "block_plan.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    # every allocation of 64 KiB or more is its own mapping, returned to the OS when freed: the RSS follows the
    # live tensors (read by the spawned processes' glibc at start)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    from oslo_models.block_plan import describe_plan

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calibration.json")
        run_distributed(_calibrate, 2, out, timeout=3600, fresh=True)
        with open(out) as handle:
            report = json.load(handle)
        plan = [dict(choice) for choice in report["plan"]]
        layouts = [("zero0", dict(data_parallel_size=2), "zero0"),
                   ("zero3", dict(data_parallel_size=2, zero_stage=3), "zero3"),
                   ("blocks " + describe_plan(om.ParallelConfig(zero_stage=3, block_plan=plan).block_plan),
                    dict(data_parallel_size=2, zero_stage=3, block_plan=plan), "blocks")]
        report["rows"] = []
        for name, options, key in layouts:
            out = os.path.join(tmp, "row.json")
            run_distributed(_measure, 2, out, name, options, args.steps, timeout=3600, fresh=True)
            with open(out) as handle:
                row = json.load(handle)
            row["predicted"] = report["predicted"][key]
            report["rows"].append(row)
    report.update(machine="2-core CPU sandbox shared with other jobs, gloo, 2 processes", torch=torch.__version__,
                  config=CONFIG, global_batch=GLOBAL_BATCH, seq_len=SEQ, load_average_before=load_before,
                  load_average_after=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    mb = 2 ** 20
    print(f"calibrated: matmul {report['matmul_flops']:.3g} FLOP/s, gloo {report['bandwidth']:.3g} B/s "
          f"{report['latency']:.2e} s; cap {report['cap'] / mb:.1f} MiB (per-block model)")
    print(f"{'layout':<28} {'pred. MiB':>9} {'(uniform)':>9} {'pred. s':>8} {'peak RSS-base MiB':>18} "
          f"{'best s':>7} {'median s':>8} {'tok/s':>7}")
    for row in report["rows"]:
        uniform = row["predicted"].get("uniform_memory")
        print(f"{row['layout']:<28} {row['predicted']['memory'] / mb:>9.1f} "
              f"{(f'{uniform / mb:.1f}' if uniform else '-'):>9} {row['predicted']['time']:>8.3f} "
              f"{row['peak_rss_minus_baseline'] / mb:>18.1f} {row['best']:>7.3f} {row['median']:>8.3f} "
              f"{row['tokens_per_second']:>7.0f}")
    with open(args.json, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
