"""The planner's predicted step-time ranking against measured step times (issue 31), on gloo CPU processes.

    python benchmarks/planner_ranking.py [--worlds 2 4] [--rounds 6] [--profile] [--json out.json]
    python benchmarks/planner_ranking.py --repredict old.json [--profile]   # re-predict, measured times kept

What runs. A small Llama (hidden 256, 4 layers, 8 heads, 4 key/value heads, intermediate 688, vocab 2048; 3.7M
parameters), global batch 8 x 128 tokens, fp32, AdamW. In ONE spawned world per size (2, 4, 8 processes), every
rank first calibrates the time model's hardware on this machine, while all ranks run together (the processes
share the machine's cores, so a rank's rate is what it gets with the others busy):

- ``matmul_flops``: the best of a few ``[tokens, h] x [h, f]``-sized fp32 matmuls (1024 x 256 x 688), each rank at
  once, the slowest rank's rate (``measured_matmul``);
- ``intra_bandwidth`` / ``intra_latency``: ``planner.time.measure_links`` (all-reduces of 1 KiB and 4 MiB on the
  world group, fitted to the ring cost), used for every group (one node).

Then every layout of ``LAYOUTS[world]`` (>= 8 per world: dp with ZeRO 0-3 and HSDP, tp with and without sp, pp
with 1F1B / interleaved microbatches, cp, checkpointing and their products) is built, wrapped as
``training.prepare`` wraps it, and all are trained round-robin, one step each per round, for a warm-up round and
``--rounds`` timed ones (the machine's load drifts alike over every layout); a step is barrier-to-barrier (forward,
backward, gradient reduction, optimizer step), and a layout's time is its fastest step (the least disturbed by the
other jobs; the median is kept too). The prediction is ``planner.search.evaluate`` with the
calibrated hardware (no accumulation: the micro-batch is the replica batch, or batch / microbatches under a
pipeline). Kendall's tau-b between predicted and measured times (hand-written; no scipy here) is reported per world
and also for a second calibration, ``effective``: the compute rate the measured dp-only ZeRO-0 layout achieves
(its FLOPs / its time), which folds the non-matmul work (norms, softmax, AdamW, autograd bookkeeping) into the rate.

``--profile`` adds a third, ``profile``: the planner's profiled time model (``planner/profile.py``). In the same
world, before the trainings, every rank times the real Llama block forward + backward at each layout's local shapes
(``Profiler``: tp local widths, ``seq / cp``, micro-batch, checkpointing; then ``refine``: all shapes again,
round-robin), the embedding/head and AdamW per parameter byte, all ranks at once (so under the same contention as
the trainings; per timed run the fastest rank's figure), and measures the overlap coefficient (``measure_overlap``) and
each collective's bandwidth and latency (``measure_collectives``) on the world group. Nothing is fitted to the
measured step times: the same figures and the same model predict every layout.

``--repredict old.json`` re-predicts from a saved report without training again (the measured step times kept):
time-model changes can be evaluated offline. With ``--profile`` and a report that holds no profile, a world of the
same size is started to measure the profile (and overlap, collectives) only.

Not in CI (minutes on the 2-core sandbox). Timings on a loaded shared machine are noisy: the JSON keeps every step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GLOBAL_BATCH, SEQ = 8, 128
CONFIG = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=688, vocab_size=2048, max_position_embeddings=SEQ)

# (ParallelConfig options, cpu_offload); micro-batch: the replica batch (pp: split into num_microbatches)
LAYOUTS = {
    2: [dict(data_parallel_size=2), dict(data_parallel_size=2, zero_stage=1),
        dict(data_parallel_size=2, zero_stage=2), dict(data_parallel_size=2, zero_stage=3),
        dict(data_parallel_size=2, activation_checkpointing="full"), dict(tensor_parallel_size=2),
        dict(tensor_parallel_size=2, sequence_parallel=True), dict(tensor_parallel_size=2,
                                                                   activation_checkpointing="selective"),
        dict(pipeline_parallel_size=2, num_microbatches=2), dict(pipeline_parallel_size=2, num_microbatches=8),
        dict(pipeline_parallel_size=2, num_microbatches=4, pipeline_schedule="interleaved_1f1b",
             virtual_pipeline_size=2), dict(context_parallel_size=2)],
    4: [dict(data_parallel_size=4), dict(data_parallel_size=4, zero_stage=2), dict(data_parallel_size=4, zero_stage=3),
        dict(data_parallel_size=4, zero_stage=2, data_parallel_shard_size=2),
        dict(tensor_parallel_size=2, data_parallel_size=2), dict(tensor_parallel_size=4),
        dict(tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2, zero_stage=1),
        dict(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2),
        dict(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4),
        dict(pipeline_parallel_size=4, num_microbatches=4), dict(context_parallel_size=2, data_parallel_size=2),
        dict(context_parallel_size=2, tensor_parallel_size=2)],
    8: [dict(data_parallel_size=8), dict(data_parallel_size=8, zero_stage=3),
        dict(tensor_parallel_size=2, data_parallel_size=4), dict(tensor_parallel_size=4, data_parallel_size=2),
        dict(tensor_parallel_size=8), dict(pipeline_parallel_size=2, data_parallel_size=4, num_microbatches=2),
        dict(pipeline_parallel_size=4, tensor_parallel_size=2, num_microbatches=4),
        dict(context_parallel_size=2, data_parallel_size=4), dict(context_parallel_size=2, tensor_parallel_size=4)],
}


def kendall_tau(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b (ties in either list counted as neither concordant nor discordant, tau-b's denominator)."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = ((concordant + discordant + ties_x) * (concordant + discordant + ties_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def measured_matmul(repeats: int = 5) -> float:
    """FLOP/s of a ``[1024, 256] x [256, 688]`` fp32 matmul (the model's MLP shape at one replica's tokens), best
    of ``repeats``, taken by every rank at once; the slowest rank's (collective)."""
    import torch.distributed as dist

    a, b = torch.randn(1024, 256), torch.randn(256, 688)
    best = float("inf")
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        best = min(best, (time.perf_counter() - start) / 10)
    rate = torch.tensor([2 * 1024 * 256 * 688 / best])
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate)


def _build(options: dict, config):
    """One layout's model, wrapped as ``training.prepare`` wraps it, its optimizer and this rank's batch."""
    import oslo_models as om
    from accelerate import Accelerator
    from oslo_models import training
    from oslo_models.data import ContextParallelSplitter

    parallel = om.ParallelConfig(**options)
    torch.manual_seed(0)
    model = om.LlamaForCausalLM.from_config(config, parallel=parallel).train()
    context = model.parallel_context
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if parallel.zero_stage:
        model, optimizer = training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=parallel.zero_stage)
    else:
        model, optimizer = training.shard_data_parallel(model, optimizer)
    ids = torch.randint(1, config.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = ids[context.dp_rank::context.dp_size].contiguous()
    batch = {"input_ids": rows, "labels": rows}
    if context.cp_size > 1:
        batch = ContextParallelSplitter(context, shift_labels=True)(batch)
    return model, training.unwrap_model(model), optimizer, batch, context.pp_size > 1


def _step(model, inner, optimizer, batch, pipelined) -> float:
    """One optimizer step, barrier to barrier (every rank of the world)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    if pipelined:
        inner.train_step(batch)
    else:
        model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - start


def calibrate_world() -> tuple[int, float, float, float]:
    """Join (or start) the gloo world and measure this machine: ``(world size, matmul FLOP/s, link bandwidth,
    link latency)``, the last two fitted on the current process group (collective)."""
    import torch.distributed as dist

    from oslo_models.planner.time import measure_links

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    matmul = measured_matmul()
    bandwidth, latency = measure_links(sizes=(1 << 10, 1 << 22))
    return dist.get_world_size(), matmul, bandwidth, latency


def measure_profile(world: int, hardware, rounds: int = 5) -> dict:
    """Every rank times the shapes this world's layouts ask for (the predictions drive the ``Profiler``), then the
    fastest rank's raw time per run is kept; plus the overlap coefficient and per-kind collective costs on the world
    group (collective)."""
    import dataclasses

    import torch.distributed as dist

    from oslo_models.planner.profile import Profiler, measure_collectives, measure_overlap

    profiler = Profiler(_facts(), groups=True)
    profiled = dataclasses.replace(hardware, profile=profiler)
    for options in LAYOUTS[world]:
        predict(world, options, profiled)
    profiler.refine(rounds=rounds)  # every shape again, round-robin: the machine's load drifts alike over all

    def least(values):  # per raw time, the least disturbed rank's (as a layout's time is its fastest step)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return tensor.tolist()

    profiler.combine(least)
    profiler.optimizer = least([profiler.optimizer])[0]
    overlap = measure_overlap()
    collectives = measure_collectives()
    return {"table": profiler.to_dict(), "overlap": overlap, "collectives": [list(c) for c in collectives]}


def _worker(out_dir: str, rounds: int, profile: bool = False, train: bool = True, profile_rounds: int = 5) -> None:
    import torch.distributed as dist
    import transformers

    from oslo_models.planner.time import Hardware

    world, matmul, bandwidth, latency = calibrate_world()
    measured = {"matmul_flops": matmul, "bandwidth": bandwidth, "latency": latency}
    if profile:
        start = time.perf_counter()
        measured["profile"] = measure_profile(world, Hardware(matmul, bandwidth, latency, bandwidth, latency, world),
                                              rounds=profile_rounds)
        measured["profile"]["seconds"] = time.perf_counter() - start
    if not train:
        if dist.get_rank() == 0:
            with open(os.path.join(out_dir, f"world{world}.json"), "w") as handle:
                json.dump(measured, handle)
        return
    config = transformers.LlamaConfig(**CONFIG)
    built = [_build(options, config) for options in LAYOUTS[world]]
    times = [[] for _ in built]
    for round_ in range(rounds + 1):  # round-robin: the machine's load drifts alike over every layout
        for i, layout in enumerate(built):
            elapsed = _step(*layout)
            if round_:  # round 0 warms up
                times[i].append(elapsed)
    memory = [_memory(world, options, layout, config) for options, layout in zip(LAYOUTS[world], built)]
    gathered = [None] * world
    dist.all_gather_object(gathered, memory)
    if dist.get_rank() == 0:
        rows = [{"options": options, "step_times": t, "memory": [per_rank[i] for per_rank in gathered]}
                for i, (options, t) in enumerate(zip(LAYOUTS[world], times))]
        with open(os.path.join(out_dir, f"world{world}.json"), "w") as handle:
            json.dump(dict(measured, rows=rows), handle)


def _memory(world: int, options: dict, layout, config) -> dict:
    """This rank's training state after its steps against ``memory.training_state`` (bytes, exact), and, for the
    layouts without a pipeline or FSDP2 (whose saved unsharded weights are not activations), the saved-tensor bytes
    of one forward against ``memory.activation_bytes``."""
    from oslo_models.planner.measured import saved_activation_bytes, state_bytes
    from oslo_models.planner.memory import activation_bytes, training_state

    model, inner, optimizer, batch, pipelined = layout
    context, parallel = inner.parallel_context, inner.parallel_context.config
    if pipelined:  # one more step, its gradients kept (the prediction is the state after a step)
        inner.train_step(batch)
    else:
        model(**batch).loss.backward()
    optimizer.step()
    state = training_state(_facts(), parallel, world, pp_rank=context.pp_rank, dp_rank=context.dp_rank,
                           cp_rank=context.cp_rank)
    out = {"rank": context.rank, "state_predicted": [state.parameters, state.gradients, state.optimizer],
           "state_measured": list(state_bytes(inner, optimizer))}
    if not pipelined and parallel.zero_stage < 2:
        out["activations_measured"] = saved_activation_bytes(inner, batch)
        out["activations_predicted"] = activation_bytes(_facts(), parallel, micro_batch=batch["input_ids"].shape[0],
                                                        seq_len=SEQ, num_microbatches=1)
    return out


def _facts():
    import transformers

    import oslo_models as om
    from oslo_models.planner.facts import ModelFacts

    if getattr(_facts, "value", None) is None:
        _facts.value = ModelFacts(om.LlamaForCausalLM, transformers.LlamaConfig(**CONFIG))
    return _facts.value


def predict(world: int, options: dict, hardware) -> dict:
    from oslo_models.composition import Layout, refusal
    from oslo_models.planner.search import evaluate

    facts = _facts()
    parallel = {k: v for k, v in options.items() if k != "zero_stage"}
    layout = Layout(parallel=parallel, zero_stage=options.get("zero_stage", 0))
    problem = refusal(layout, facts.model_class, facts.config)
    if problem:
        raise ValueError(f"{options}: refused by the composition check: {problem}")
    dp = layout.parallel_config().resolve_data_parallel_size(world)
    m = options.get("num_microbatches", 1) if options.get("pipeline_parallel_size", 1) > 1 else 1
    candidate = evaluate(facts, layout, world, hardware, micro_batch=GLOBAL_BATCH // dp // m, num_microbatches=m,
                         global_batch=GLOBAL_BATCH, seq_len=SEQ)
    return {"layout": candidate.describe(), "total": candidate.time.total, "compute": candidate.time.compute,
            "communication": dict(candidate.time.communication), "bubble": candidate.time.bubble,
            "flops": facts.flops_per_token(SEQ) * GLOBAL_BATCH * SEQ}


def predictions(world: int, measured: dict) -> dict:
    """The world's rows with the predictions of every calibration, and the taus (no measuring)."""
    from dataclasses import replace

    from oslo_models.planner.profile import ProfileTable
    from oslo_models.planner.time import Hardware

    calibrated = Hardware(measured["matmul_flops"], measured["bandwidth"], measured["latency"],
                          measured["bandwidth"], measured["latency"], devices_per_node=world)
    rows = []
    for row in measured["rows"]:
        rows.append({"options": row["options"], "step_times": row["step_times"], "measured": min(row["step_times"]),
                     **({"memory": row["memory"]} if "memory" in row else {}),
                     "median": statistics.median(row["step_times"]),
                     "predicted": predict(world, row["options"], calibrated)})
    # the effective rate: the first layout (dp only, ZeRO-0) with its communication taken out
    first = rows[0]
    effective_rate = first["predicted"]["flops"] / world / max(
        1e-9, first["measured"] - sum(first["predicted"]["communication"].values()))
    effective = replace(calibrated, matmul_flops=effective_rate)
    kinds = ["predicted", "predicted_effective"]
    for row in rows:
        row["predicted_effective"] = predict(world, row["options"], effective)
    out = {"hardware": {k: v for k, v in measured.items() if k != "rows"}, "effective_flops": effective_rate}
    if "profile" in measured:
        profile = measured["profile"]
        profiled = replace(calibrated, overlap=profile["overlap"],
                           collectives=tuple(tuple(c) for c in profile["collectives"]),
                           profile=ProfileTable.from_dict(profile["table"]))
        kinds.append("predicted_profile")
        for row in rows:
            row["predicted_profile"] = predict(world, row["options"], profiled)
    for kind in kinds:
        name = {"predicted": "kendall_tau", "predicted_effective": "kendall_tau_effective",
                "predicted_profile": "kendall_tau_profile"}[kind]
        out[name] = kendall_tau([r[kind]["total"] for r in rows], [r["measured"] for r in rows])
    out["rows"] = rows
    if all("memory" in row for row in rows):
        out["memory"] = memory_summary(rows)
    return out


def memory_summary(rows: list) -> dict:
    """Training-state bytes equal on every rank (layouts), activations within 10% (layouts, the largest error)."""
    exact = sum(all(m["state_predicted"] == m["state_measured"] for m in row["memory"]) for row in rows)
    errors = [abs(m["activations_predicted"] - m["activations_measured"]) / m["activations_measured"]
              for row in rows for m in row["memory"] if "activations_measured" in m]
    checked = sum(any("activations_measured" in m for m in row["memory"]) for row in rows)
    within = sum(all(abs(m["activations_predicted"] - m["activations_measured"]) <= 0.1 * m["activations_measured"]
                     for m in row["memory"] if "activations_measured" in m)
                 for row in rows if any("activations_measured" in m for m in row["memory"]))
    return {"state_exact_layouts": exact, "layouts": len(rows), "activation_layouts": checked,
            "activations_within_10pct": within, "activation_max_error": max(errors, default=0.0)}


def show(world: int, result: dict) -> None:
    hw = result["hardware"]
    profile = hw.get("profile")
    print(f"world {world}: matmul {hw['matmul_flops']:.3g} FLOP/s, effective {result['effective_flops']:.3g}, "
          f"gloo {hw['bandwidth']:.3g} B/s {hw['latency']:.2e} s; tau {result['kendall_tau']:.3f} "
          f"(effective rate: {result['kendall_tau_effective']:.3f}"
          + (f", profile: {result['kendall_tau_profile']:.3f}" if profile else "") + ")")
    if profile:
        print(f"  profile: overlap {profile['overlap']:.3f}, "
              + ", ".join(f"{k} {b:.3g} B/s {lat:.2e} s" for k, b, lat in profile["collectives"])
              + f", optimizer {profile['table']['optimizer']:.3g} s/B, {len(profile['table']['blocks'])} block "
              f"shapes")
    if "memory" in result:
        m = result["memory"]
        print(f"  memory: training state equal to the prediction on every rank in {m['state_exact_layouts']} of "
              f"{m['layouts']} layouts; activations within 10% on every rank in {m['activations_within_10pct']} of "
              f"{m['activation_layouts']} (largest error {100 * m['activation_max_error']:.1f}%)")
    for r in sorted(result["rows"], key=lambda r: r["measured"]):
        extra = f", profile {r['predicted_profile']['total']:.3f} s" if profile else ""
        print(f"  {r['predicted']['layout']:<40} measured {r['measured']:.3f} s  predicted "
              f"{r['predicted']['total']:.3f} s (effective {r['predicted_effective']['total']:.3f} s{extra})")


def main() -> None:
    import tempfile

    from tests.helpers.dist import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per layout (round-robin, after a warm-up)")
    parser.add_argument("--profile", action="store_true", help="also the profiled time model (planner/profile.py)")
    parser.add_argument("--profile-rounds", type=int, default=5,
                        help="times every profiled shape is timed again, round-robin (Profiler.refine)")
    parser.add_argument("--repredict", help="a saved report: predict again, without training (times kept)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "planner_ranking.json"))
    args = parser.parse_args()
    if args.repredict:
        with open(args.repredict) as handle:
            report = json.load(handle)
        report["repredicted_from"] = args.repredict
    else:
        report = {"machine": "2-core CPU sandbox shared with other jobs, gloo", "torch": torch.__version__,
                  "load_average_before": os.getloadavg(), "config": CONFIG, "global_batch": GLOBAL_BATCH,
                  "seq_len": SEQ, "worlds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (map(int, report["worlds"]) if args.repredict else args.worlds):
            start = time.perf_counter()
            if args.repredict:
                old = report["worlds"][str(world)]
                measured = dict(old["hardware"], rows=old["rows"])
                if args.profile and "profile" not in measured:  # measure the profile alone in a fresh world
                    run_distributed(_worker, world, tmp, 0, True, False, args.profile_rounds, timeout=3600)
                    with open(os.path.join(tmp, f"world{world}.json")) as handle:
                        measured["profile"] = json.load(handle)["profile"]
                    report["profile_load_average"] = os.getloadavg()
            else:
                run_distributed(_worker, world, tmp, args.rounds, args.profile, True, args.profile_rounds, timeout=3600)
                with open(os.path.join(tmp, f"world{world}.json")) as handle:
                    measured = json.load(handle)
            result = predictions(world, measured)
            result["seconds"] = time.perf_counter() - start
            report["worlds"][str(world)] = result
            show(world, result)
    if not args.repredict:
        report["load_average_after"] = os.getloadavg()
    with open(args.json, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
