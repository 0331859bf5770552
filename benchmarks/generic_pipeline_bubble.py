"""Pipeline bubble of a generic-path model (issue 50): measured idle fraction per stage of ``transformers``' own
class pipelined by ``oslo_models`` (``generic/pipeline_stage.py``) against the schedules' theory.

What runs: a random Granite (no native family: ``transformers.GraniteForCausalLM``, hidden ``--hidden``, ``--layers``
layers, vocabulary 512 so the head is small next to a stage's layers), loaded with
``om.AutoModelForCausalLM.from_pretrained(..., parallel=ParallelConfig(pipeline_parallel_size=p, ...))`` in ``p``
gloo processes (dp 1), trained with ``model.train_step`` on ``m`` microbatches of ``--rows`` x ``--seq`` tokens
(``m * rows`` rows per step) for GPipe, 1F1B and interleaved 1F1B (``v = 2`` stages per rank).

Measured per rank and timed step: ``busy`` = CPU time of the rank's main thread during the step
(``time.thread_time``; one intra-op thread, so the stage's compute, the schedule's Python and the posting of its
sends/receives; waiting for a neighbour's activation or gradient costs no CPU), ``wall`` = the step's wall time over
the pipeline group (latest end minus earliest start, one machine's monotonic clock, a barrier before each step);
``idle = 1 - busy / wall``. Reported: the median over ``--repeats`` timed steps (after ``--warmup`` untimed ones) per
rank, their mean, and the theory with equal stages and no communication cost: ``(p - 1) / (m + p - 1)`` for GPipe
and 1F1B, ``(p - 1) / (v m + p - 1)`` for interleaved (``pipeline_bubble.closed_form``). The stages are not equal
(the first holds the embedding, the last the norm, head and loss): "theory paced" lets the slowest stage pace the
schedule, ``1 - (busy_r / max busy) (1 - theory)`` for rank ``r`` (its bubble plus the wait for the slower stage),
from the measured busy times. A CPU shared with other jobs stretches ``wall`` (not ``busy``): ``--realtime PRIO`` runs
the workers under SCHED_FIFO (needs the privilege).

    OMP_NUM_THREADS=1 python benchmarks/generic_pipeline_bubble.py [--quick] [--realtime 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_bubble import closed_form  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _config(args):
    import transformers

    return transformers.GraniteConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=args.seq, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)


def _worker(rank, world, port, cfg, path, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if cfg["realtime"]:  # before gloo starts its threads, so that they inherit the policy
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(cfg["realtime"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import oslo_models as om

    results = []
    generator = torch.Generator().manual_seed(0)
    for m in cfg["microbatches"]:
        ids = torch.randint(3, 512, (m * cfg["rows"], cfg["seq"]), generator=generator)
        batch = {"input_ids": ids, "labels": ids}
        for name in cfg["schedules"]:
            v = 2 if name == "interleaved_1f1b" else 1
            parallel = om.ParallelConfig(pipeline_parallel_size=world, num_microbatches=m, pipeline_schedule=name,
                                         virtual_pipeline_size=v)
            model = om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            idle = []
            for step in range(cfg["warmup"] + cfg["repeats"]):
                dist.barrier()
                start, cpu = time.monotonic(), time.thread_time()
                model.train_step(batch)
                busy, end = time.thread_time() - cpu, time.monotonic()
                optimizer.step(), optimizer.zero_grad()
                times = [None] * world
                dist.all_gather_object(times, (start, end, busy))
                if step >= cfg["warmup"]:
                    wall = max(t[1] for t in times) - min(t[0] for t in times)
                    idle.append([1 - t[2] / wall for t in times] + [t[2] for t in times] + [wall])
            per_rank = [statistics.median(step[r] for step in idle) for r in range(world)]
            busy = [statistics.median(step[world + r] for step in idle) for r in range(world)]
            theory = closed_form(name, world, m, v)
            mean = sum(per_rank) / world
            # the slowest stage paces the schedule: the others wait in proportion to their lighter work
            paced = [1 - (b / max(busy)) * (1 - theory) for b in busy]
            results.append(dict(pp=world, m=m, schedule=name, v=v, idle_per_rank=per_rank, idle_mean=mean,
                                theory=theory, rel_error=(mean - theory) / theory, busy_s_per_rank=busy,
                                theory_paced_per_rank=paced, theory_paced_mean=sum(paced) / world,
                                paced_rel_error=(mean - sum(paced) / world) / (sum(paced) / world),
                                step_s=statistics.median(step[-1] for step in idle)))
            del model, optimizer
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rows", type=int, default=1, help="rows per microbatch")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--realtime", type=int, default=0, metavar="PRIO")
    ap.add_argument("--quick", action="store_true", help="m = 4, 1F1B, hidden 64, seq 32, one timed step")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    if a.quick:
        a.microbatches, a.schedules, a.hidden, a.seq, a.repeats = [4], ["1f1b"], 64, 32, 1
    import transformers

    cfg = dict(microbatches=a.microbatches, schedules=a.schedules, rows=a.rows, seq=a.seq, warmup=a.warmup,
               repeats=a.repeats, realtime=a.realtime)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        path = os.path.join(tmp, "granite")
        transformers.GraniteForCausalLM(_config(a)).save_pretrained(path)
        out = os.path.join(tmp, "results.json")
        start = time.time()
        torch.multiprocessing.spawn(_worker, args=(a.pp, _free_port(), cfg, path, out), nprocs=a.pp)
        with open(out) as f:
            results = json.load(f)
    print(f"| pp | m | schedule | idle mean | theory | rel. error | theory paced | rel. error paced | idle per stage "
          f"| theory paced per stage | busy s per stage | step s |  ({time.time() - start:.0f} s)")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def join(values, digits=3):
        return " / ".join(f"{x:.{digits}f}" for x in values)

    for r in results:
        print(f"| {r['pp']} | {r['m']} | {r['schedule']} | {r['idle_mean']:.4f} | {r['theory']:.4f} | "
              f"{100 * r['rel_error']:+.1f}% | {r['theory_paced_mean']:.4f} | {100 * r['paced_rel_error']:+.1f}% | "
              f"{join(r['idle_per_rank'])} | {join(r['theory_paced_per_rank'])} | {join(r['busy_s_per_rank'])} | "
              f"{r['step_s']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), results=results), f, indent=1)


if __name__ == "__main__":
    main()
