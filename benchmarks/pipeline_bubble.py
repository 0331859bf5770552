"""Pipeline bubble benchmark (issue 7): measured idle fraction per stage vs theory, and peak in-flight activations.

Each pipeline stage is a tiny module whose forward sleeps ``--t-fwd`` seconds and whose backward sleeps twice
that (an ``autograd.Function``), so the busy time per rank is known and recorded (the measured duration of every
sleep actually executed). Stages are ``torch.distributed.pipelining.PipelineStage`` objects built with static
shapes (as ``oslo_models/pipeline/runner.py`` does: meta ``input_args``/``output_args``, no shape probing),
driven by torch's schedules over gloo processes started with ``torch.multiprocessing.spawn``.

Per rank: ``idle = 1 - busy / wall`` where ``wall`` is the step's wall time over the whole pipeline group (latest
end minus earliest start, all ranks on one machine share the monotonic clock). Theory for GPipe / 1F1B:
``(p - 1) / (m + p - 1)``; for interleaved 1F1B with ``v`` stages per rank: ``(p - 1) / (v m + p - 1)``.

Peak activation memory: each forward saves a tensor of ``--act-numel`` floats for its backward; the module
counts how many are alive (in-flight microbatches) and their bytes. GPipe holds ``m`` on every stage, 1F1B at
most ``p - rank``.

    python benchmarks/pipeline_bubble.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        module._sleep(module.t_fwd)
        ctx.module = module
        saved = torch.empty(module.act_numel)
        module._alloc(saved)
        ctx.save_for_backward(saved)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        module = ctx.module
        module._sleep(2 * module.t_fwd)
        module._free(saved)
        return grad.clone(), None


class SleepStage(nn.Module):
    """Forward sleeps ``t_fwd``, backward ``2 t_fwd``; records busy seconds and live saved activations."""

    def __init__(self, t_fwd: float, act_numel: int, counters: dict):
        super().__init__()
        self.t_fwd, self.act_numel, self.c = t_fwd, act_numel, counters
        self.weight = nn.Parameter(torch.ones(()))

    def _sleep(self, t):
        t0 = time.perf_counter()
        time.sleep(t)
        self.c["busy"] += time.perf_counter() - t0

    def _alloc(self, saved):
        self.c["live"] += 1
        self.c["live_bytes"] += saved.numel() * saved.element_size()
        self.c["peak"] = max(self.c["peak"], self.c["live"])
        self.c["peak_bytes"] = max(self.c["peak_bytes"], self.c["live_bytes"])

    def _free(self, saved):
        self.c["live"] -= 1
        self.c["live_bytes"] -= saved.numel() * saved.element_size()

    def forward(self, x):
        return _Sleep.apply(x * self.weight, self)


def _loss(out, target):
    return ((out - target) ** 2).sum()


def theory(schedule: str, p: int, m: int, v: int) -> float:
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def _worker(rank, world, port, cfg, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
    p, hidden, v = world, cfg["hidden"], cfg["virtual"]
    results = []
    for m in cfg["microbatches"]:
        for name in cfg["schedules"]:
            multi = name == "interleaved_1f1b"
            n_local = v if multi else 1
            num_stages = p * n_local
            counters = dict(busy=0.0, live=0, live_bytes=0, peak=0, peak_bytes=0)
            meta = torch.empty(1, hidden, device="meta")
            stages = []
            for j in range(n_local):
                idx = rank + j * p  # looped placement, as torch's interleaved schedules expect
                mod = SleepStage(cfg["t_fwd"] / n_local, cfg["act_numel"], counters)
                stages.append(PipelineStage(mod, idx, num_stages, torch.device("cpu"),
                                            input_args=meta.detach().requires_grad_(True),
                                            output_args=meta.detach().requires_grad_(True)))
            try:
                sched = (classes[name](stages, m, loss_fn=_loss, scale_grads=False) if multi
                         else classes[name](stages[0], m, loss_fn=_loss, scale_grads=False))
                x, y = torch.randn(m, hidden), torch.randn(m, hidden)
                rows = []
                for it in range(cfg["warmup"] + cfg["repeats"]):
                    for k in ("busy", "peak", "peak_bytes"):
                        counters[k] = 0
                    dist.barrier()
                    t0 = time.monotonic()
                    kwargs = {}
                    if rank == 0:
                        args = (x,)
                    else:
                        args = ()
                    if rank == (num_stages - 1) % p:
                        kwargs = dict(target=y, losses=[])
                    sched.step(*args, **kwargs)
                    t1 = time.monotonic()
                    gathered = [None] * world
                    dist.all_gather_object(gathered, (t0, t1, counters["busy"], counters["peak"],
                                                      counters["peak_bytes"]))
                    if it >= cfg["warmup"]:
                        rows.append(gathered)
                    for s in stages:
                        s.submod.zero_grad(set_to_none=True)
                err = None
            except Exception as e:  # noqa: BLE001 - report and continue with the other schedules
                rows, err = [], f"{type(e).__name__}: {e}"
            if rank == 0:
                rec = dict(pp=p, m=m, schedule=name, virtual=n_local, theory=theory(name, p, m, n_local), error=err)
                if rows:
                    idle = [[0.0] * world for _ in rows]
                    walls = []
                    for i, g in enumerate(rows):
                        wall = max(r[1] for r in g) - min(r[0] for r in g)
                        walls.append(wall)
                        for r in range(world):
                            idle[i][r] = 1 - g[r][2] / wall
                    per_stage = [sum(idle[i][r] for i in range(len(rows))) / len(rows) for r in range(world)]
                    ideal_busy = (m * 3 * cfg["t_fwd"])
                    rec.update(idle_per_rank=per_stage, idle_max=max(per_stage), idle_mean=sum(per_stage) / world,
                               wall_s=sum(walls) / len(walls), ideal_busy_s=ideal_busy,
                               peak_inflight_per_rank=[rows[-1][r][3] for r in range(world)],
                               peak_act_bytes_per_rank=[rows[-1][r][4] for r in range(world)])
                    rec["rel_error_mean"] = (rec["idle_mean"] - rec["theory"]) / rec["theory"]
                results.append(rec)
                print(_fmt(rec), flush=True)
            dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


HEADER = ("| pp | m | schedule | idle max | idle mean | theory | rel. error (mean) | idle per stage | "
          "peak in-flight per stage | peak act. KiB per stage | step s |")


def _fmt(r):
    if r.get("error"):
        return f"| {r['pp']} | {r['m']} | {r['schedule']} | failed: {r['error'][:120]} |"
    return (f"| {r['pp']} | {r['m']} | {r['schedule']} | {r['idle_max']:.3f} | {r['idle_mean']:.3f} | "
            f"{r['theory']:.3f} | {100 * r['rel_error_mean']:+.1f}% | "
            f"{' / '.join(f'{i:.3f}' for i in r['idle_per_rank'])} | "
            f"{' / '.join(str(n) for n in r['peak_inflight_per_rank'])} | "
            f"{' / '.join(f'{b / 1024:.0f}' for b in r['peak_act_bytes_per_rank'])} | {r['wall_s']:.2f} |")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--t-fwd", type=float, default=0.05, help="forward sleep per stage per microbatch (s)")
    ap.add_argument("--virtual", type=int, default=2, help="stages per rank for interleaved_1f1b")
    ap.add_argument("--act-numel", type=int, default=256 * 1024, help="floats saved per forward (activation)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="pp=2, m=4, one repeat, t_fwd=10 ms")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    if a.quick:
        a.pp, a.microbatches, a.repeats, a.t_fwd = [2], [4], 1, 0.01
    cfg = dict(microbatches=a.microbatches, schedules=a.schedules, t_fwd=a.t_fwd, virtual=a.virtual,
               act_numel=a.act_numel, hidden=a.hidden, warmup=a.warmup, repeats=a.repeats)
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    results = []
    t_start = time.time()
    for p in a.pp:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            mp.spawn(_worker, args=(p, _free_port(), cfg, out), nprocs=p, join=True)
            with open(out) as f:
                results.extend(json.load(f))
    print(f"total {time.time() - t_start:.1f} s", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(config=cfg, pp=a.pp, results=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
