"""Pipeline bubble benchmark (issue 7): measured idle fraction per stage vs theory, and peak in-flight activations.

What runs. Each pipeline stage is a synthetic module with a known cost per microbatch, split the way zero-bubble
schedules need it: ``forward`` sleeps ``t`` (``--t-fwd``); the backward is two separate autograd nodes,

- ``_InputPart`` on the activation path: its backward (the *input-gradient* pass, "I") sleeps ``t``;
- ``_WeightPart`` on the parameter path: its backward (the *weight-gradient* pass, "W") sleeps ``t``;

and the stage output is ``_InputPart(x) + _WeightPart(weight)``. A full backward ("B": GPipe, 1F1B, interleaved
1F1B) runs both (2 ``t``); torch's split backward (``stage_backward_input`` = ``autograd.grad`` w.r.t. the stage
inputs, then ``stage_backward_weight`` from the saved intermediate gradients to the parameters) runs only the first,
then only the second. Multi-stage schedules put ``v`` (``--virtual``) stages of ``t / v`` each on every rank, so every
rank always has ``3 m t`` of work. Every sleep actually executed is timed and summed ("busy").

Schedules: torch's ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` and
``ScheduleInterleavedZeroBubble`` ("zero_bubble", ZB1P; as ``oslo_models/pipeline/runner.py`` runs it, with ``v``
stages per rank), on ``PipelineStage`` objects with static shapes (meta ``input_args``/``output_args``), over gloo
processes started with ``torch.multiprocessing.spawn``.

Measured: per rank ``idle = 1 - busy / wall``, with ``wall`` the step's wall time over the whole pipeline group
(latest end minus earliest start; all ranks share one machine's monotonic clock). Reported per stage (rank), and the
mean over ranks is compared with theory.

Theory (no communication or bookkeeping cost, F = I = W = t / v per stage):

- GPipe, 1F1B: ``(p - 1) / (m + p - 1)``;
- interleaved 1F1B: ``(p - 1) / (v m + p - 1)``;
- zero_bubble: no closed form is used. The theory is the idle fraction of the schedule's own action list
  (``schedule.pipeline_order``, the compute actions torch executes on each rank, in order) replayed by an exact
  event simulation (``simulate``) with the durations above, including torch's one asymmetry: on global stage 0 the
  I action is a no-op and its W action runs the full backward (``2 t / v``), since the first stage has no input
  gradient to send. For p in {2, 4}, m in {4, 8, 16}, v = 2 it comes out as ``(p - 1) / (3 v m + p - 1)``: one chunk
  forward (``t / v``) of idle per hop, against ``3 t`` per hop for 1F1B. (For reference, the paper's ZB-H1 with
  v = 1 and T_F = T_B = T_W gives ``(p - 1) / (3 m + p - 1)``.)

The same simulation is also run for the other three schedules (``sim`` in the JSON) as a cross-check of the closed
forms; for GPipe and 1F1B the executed order is rebuilt from their ``_step_microbatches`` (see ``compute_order``).

Per-action overhead. What the theory leaves out is a cost per compute action (gloo send/recv of the activation or
gradient and the wake-ups it needs, the schedule's Python bookkeeping, autograd graph walks), which is large relative
to a small bubble. Two estimates are reported, in ms per action, next to (never instead of) the plain theory:

- ``c calib.``: measured before the timed steps: ``--calib`` steps with all sleeps set to 0; their median wall time
  divided by the simulated critical path length in actions. "theory + c" is the simulation with every action
  lengthened by that ``c`` (the extra time counted as idle, as in the measurement): a prediction.
- ``c implied``: the ``c`` for which that simulation reproduces the measured idle fraction (bisection): a diagnostic.
  If it is about the same in every cell, one per-action cost explains the excess.

The pass/fail target is the plain theory: ``|idle mean - theory| / theory <= 10%``.

Peak activation memory: each forward saves ``--act-numel`` floats; they stay alive until both backward parts of that
microbatch have run (for zero_bubble: until its W). The module counts how many are alive (in-flight microbatches)
and their bytes. GPipe holds ``m`` on every stage, 1F1B at most ``p - rank``.

    python benchmarks/pipeline_bubble.py [--quick] [--realtime PRIO] [--json out.json]

On a shared machine, ``--realtime 10`` (SCHED_FIFO workers; needs the privilege) keeps other processes from
delaying the workers' wake-ups; the table in BENCHMARKS.md was measured with it.
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
import torch.multiprocessing as mp
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")
TARGET = 0.10  # measured idle within 10% (relative) of theory


# ---------------------------------------------------------------------------------------------- synthetic stage
class _InputPart(torch.autograd.Function):
    """Activation path: forward sleeps ``t_fwd``; backward (the input-gradient work) sleeps ``t_bwd_input``."""

    @staticmethod
    def forward(ctx, x, anchor, module, token):
        module._sleep(module.t_fwd)
        ctx.module, ctx.token = module, token
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.module._sleep(ctx.module.t_bwd_input)
        ctx.module._release(ctx.token)
        return grad.clone(), None, None, None


class _WeightPart(torch.autograd.Function):
    """Parameter path: free forward; backward (the weight-gradient work) sleeps ``t_bwd_weight``."""

    @staticmethod
    def forward(ctx, weight, module, token):
        ctx.module, ctx.token = module, token
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.module._sleep(ctx.module.t_bwd_weight)
        ctx.module._release(ctx.token)
        return grad.clone(), None, None


class SleepStage(nn.Module):
    """Forward ``t``, input-grad backward ``t``, weight-grad backward ``t``; records busy seconds and live activations.

    ``anchor`` (a leaf that requires grad, not a parameter) keeps the activation path differentiable on the first
    stage, whose input does not require grad, so its full backward also does the input-gradient work, as on every
    other stage (uniform stages, as the closed-form theory assumes).
    """

    def __init__(self, t: float, act_numel: int, counters: dict):
        super().__init__()
        self.act_numel, self.c = act_numel, counters
        self.set_time(t)
        self.weight = nn.Parameter(torch.ones(()))
        self.anchor = torch.zeros((), requires_grad=True)

    def set_time(self, t: float):
        self.t_fwd = self.t_bwd_input = self.t_bwd_weight = t

    def _sleep(self, t):
        if t <= 0:
            return
        t0 = time.perf_counter()
        time.sleep(t)
        self.c["busy"] += time.perf_counter() - t0

    def _alloc(self):
        saved = torch.empty(self.act_numel)
        nbytes = saved.numel() * saved.element_size()
        self.c["live"] += 1
        self.c["live_bytes"] += nbytes
        self.c["peak"] = max(self.c["peak"], self.c["live"])
        self.c["peak_bytes"] = max(self.c["peak_bytes"], self.c["live_bytes"])
        return dict(saved=saved, nbytes=nbytes, pending=2)

    def _release(self, token):
        token["pending"] -= 1
        if token["pending"] == 0:  # both the input-grad and the weight-grad part have run
            self.c["live"] -= 1
            self.c["live_bytes"] -= token["nbytes"]
            token["saved"] = None

    def forward(self, x):
        token = self._alloc()
        return _InputPart.apply(x, self.anchor, self, token) + _WeightPart.apply(self.weight, self, token)


def _loss(out, target):
    return ((out - target) ** 2).sum()


# ---------------------------------------------------------------------------------------------- theory
def closed_form(schedule: str, p: int, m: int, v: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return None  # zero_bubble: simulated


def simulate(order: dict, num_stages: int, t_stage: float, overhead: float = 0.0, unit: bool = False):
    """Replay per-rank compute action lists; return (wall, busy per rank) in seconds.

    ``order``: rank -> list of ``(stage, kind, microbatch)`` with kind in F, B (full backward), I, W, executed in
    order on each rank, each starting when the rank is free and its dependencies are done: F(s) after F(s-1);
    B/I(s) after F(s) and the input gradient of s+1 (its B or I); W(s) after I(s). Durations: F = I = W = t_stage,
    B = 2 t_stage, except on stage 0, where I is a no-op and W the full backward (torch skips the input-gradient
    pass of the first stage). ``overhead`` is added to every action (and not counted as busy). ``unit``: every action
    takes 1 (for counting the critical path in actions).
    """
    def duration(stage, kind):
        if unit:
            return 0.0
        if kind == "B" or (kind == "W" and stage == 0):
            return 2 * t_stage
        if kind == "I" and stage == 0:
            return 0.0
        return t_stage

    extra = 1.0 if unit else overhead
    done: dict = {}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    ptr = {r: 0 for r in order}
    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for r, acts in order.items():
            while ptr[r] < len(acts):
                s, kind, mb = acts[ptr[r]]
                if kind == "F":
                    deps = [("F", s - 1, mb)] if s > 0 else []
                elif kind in ("B", "I"):
                    deps = [("F", s, mb)] + ([("dx", s + 1, mb)] if s < num_stages - 1 else [])
                else:  # W
                    deps = [("dx", s, mb)]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                d = duration(s, kind)
                end = start + d + extra
                busy[r] += d
                free[r] = end
                done[("F" if kind == "F" else "dx" if kind in ("B", "I") else "W", s, mb)] = end
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks in simulation at {ptr}")
    return max(free.values()), [busy[r] for r in sorted(order)]


def compute_order(sched, name: str, p: int, m: int) -> dict:
    """Per-rank compute actions ``(stage, kind, microbatch)`` in the order torch executes them.

    Multi-stage schedules run their IR (``schedule.pipeline_order``, with ``None`` bubbles) as is, so that is read.
    GPipe and 1F1B run hand-written loops (``_step_microbatches``) whose order is rebuilt here: GPipe all F then all
    B, both in microbatch order; 1F1B ``min(m, p - rank)`` warm-up F, then B/F alternating, then the remaining B.
    (Their ``_get_pipeline_order()`` IR is not used: for 1F1B it does not match the executed order.)
    """
    if name in MULTI_STAGE:
        return {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts
                    if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
                for r, acts in sched.pipeline_order.items()}
    order = {}
    for r in range(p):
        if name == "gpipe":
            order[r] = [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)]
            continue
        warm = min(m, p - r)
        acts = [(r, "F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            acts += [(r, "B", b), (r, "F", f)]
            f, b = f + 1, b + 1
        acts += [(r, "B", i) for i in range(b, m)]
        order[r] = acts
    return order


def sim_idle(order, num_stages, t_stage, overhead=0.0):
    """Mean idle fraction over ranks of the simulated schedule (``overhead`` per action counted as idle)."""
    wall, busy = simulate(order, num_stages, t_stage, overhead)
    idle = [1 - b / wall for b in busy]
    return sum(idle) / len(idle)


def implied_overhead(order, num_stages, t_stage, measured_idle):
    """The per-action overhead ``c`` for which the simulation reproduces ``measured_idle`` (0 if below theory)."""
    lo, hi = 0.0, t_stage
    if measured_idle <= sim_idle(order, num_stages, t_stage):
        return 0.0
    while sim_idle(order, num_stages, t_stage, hi) < measured_idle:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sim_idle(order, num_stages, t_stage, mid) < measured_idle else (lo, mid)
    return (lo + hi) / 2


# ---------------------------------------------------------------------------------------------- worker
def _worker(rank, world, port, cfg, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if cfg["realtime"]:  # before gloo starts its threads, so that they inherit the policy
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(cfg["realtime"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
               "zero_bubble": ScheduleInterleavedZeroBubble}
    p, hidden, v = world, cfg["hidden"], cfg["virtual"]
    results = []
    for m in cfg["microbatches"]:
        for name in cfg["schedules"]:
            multi = name in MULTI_STAGE
            n_local = v if multi else 1
            num_stages = p * n_local
            t_stage = cfg["t_fwd"] / n_local
            counters = dict(busy=0.0, live=0, live_bytes=0, peak=0, peak_bytes=0)
            meta = torch.empty(1, hidden, device="meta")
            stages, mods = [], []
            for j in range(n_local):
                idx = rank + j * p  # looped placement, as torch's interleaved schedules expect
                mod = SleepStage(t_stage, cfg["act_numel"], counters)
                mods.append(mod)
                stages.append(PipelineStage(mod, idx, num_stages, torch.device("cpu"),
                                            input_args=meta.detach().requires_grad_(True),
                                            output_args=meta.detach().requires_grad_(True)))
            rec = dict(pp=p, m=m, schedule=name, virtual=n_local, theory=closed_form(name, p, m, n_local), error=None)
            try:
                sched = (classes[name](stages, m, loss_fn=_loss, scale_grads=False) if multi
                         else classes[name](stages[0], m, loss_fn=_loss, scale_grads=False))
                x, y = torch.randn(m, hidden), torch.randn(m, hidden)

                def step():
                    for k in ("busy", "peak", "peak_bytes"):
                        counters[k] = 0
                    dist.barrier()
                    t0 = time.monotonic()
                    kwargs = dict(target=y, losses=[]) if rank == (num_stages - 1) % p else {}
                    sched.step(*((x,) if rank == 0 else ()), **kwargs)
                    t1 = time.monotonic()
                    gathered = [None] * world
                    dist.all_gather_object(gathered, (t0, t1, counters["busy"], counters["peak"],
                                                      counters["peak_bytes"]))
                    for s in stages:
                        s.submod.zero_grad(set_to_none=True)
                    return gathered

                # warm-up and overhead calibration: all sleeps 0
                for mod in mods:
                    mod.set_time(0.0)
                calib = [step() for _ in range(cfg["warmup"] + cfg["calib"])][cfg["warmup"]:]
                for mod in mods:
                    mod.set_time(t_stage)
                rows = [step() for _ in range(cfg["repeats"])]
            except Exception as e:  # noqa: BLE001 - report and continue with the other schedules
                rows, rec["error"] = [], f"{type(e).__name__}: {e}"
            if rank == 0 and rows:
                order = compute_order(sched, name, p, m)
                sim = sim_idle(order, num_stages, t_stage)
                if rec["theory"] is None:
                    rec["theory"] = sim
                walls0 = [max(r[1] for r in g) - min(r[0] for r in g) for g in calib]
                crit, _ = simulate(order, num_stages, 0.0, unit=True)
                c = statistics.median(walls0) / crit
                idle, walls = [], []
                for g in rows:
                    wall = max(r[1] for r in g) - min(r[0] for r in g)
                    walls.append(wall)
                    idle.append([1 - g[r][2] / wall for r in range(world)])
                per_stage = [sum(i[r] for i in idle) / len(idle) for r in range(world)]
                rec.update(sim=sim, overhead_s=c, critical_path_actions=crit, calib_wall_s=walls0,
                           theory_with_overhead=sim_idle(order, num_stages, t_stage, c),
                           idle_per_rank=per_stage, idle_max=max(per_stage), idle_mean=sum(per_stage) / world,
                           wall_s=sum(walls) / len(walls), ideal_busy_s=3 * m * cfg["t_fwd"],
                           busy_s_per_rank=[rows[-1][r][2] for r in range(world)],
                           peak_inflight_per_rank=[rows[-1][r][3] for r in range(world)],
                           peak_act_bytes_per_rank=[rows[-1][r][4] for r in range(world)])
                rec["rel_error_mean"] = (rec["idle_mean"] - rec["theory"]) / rec["theory"]
                rec["overhead_implied_s"] = implied_overhead(order, num_stages, t_stage, rec["idle_mean"])
                rec["within_target"] = abs(rec["rel_error_mean"]) <= TARGET
            if rank == 0:
                results.append(rec)
                print(_fmt(rec), flush=True)
            dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- report
HEADER = ("| pp | m | schedule | idle mean | theory | rel. error | within 10% | c calib. ms | theory + c | "
          "c implied ms | idle per stage | peak in-flight per stage | peak act. KiB per stage | step s |")


def _fmt(r):
    if r.get("error"):
        return f"| {r['pp']} | {r['m']} | {r['schedule']} | failed: {r['error'][:120]} |"
    return (f"| {r['pp']} | {r['m']} | {r['schedule']} | {r['idle_mean']:.4f} | {r['theory']:.4f} | "
            f"{100 * r['rel_error_mean']:+.1f}% | {'yes' if r['within_target'] else '**no**'} | "
            f"{1e3 * r['overhead_s']:.2f} | {r['theory_with_overhead']:.4f} | {1e3 * r['overhead_implied_s']:.2f} | "
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
    ap.add_argument("--t-fwd", type=float, default=0.3,
                    help="forward sleep per rank per microbatch (s); input-grad and weight-grad backward the same")
    ap.add_argument("--virtual", type=int, default=2, help="stages per rank for interleaved_1f1b and zero_bubble")
    ap.add_argument("--act-numel", type=int, default=256 * 1024, help="floats saved per forward (activation)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps (sleeps 0) per configuration")
    ap.add_argument("--calib", type=int, default=3, help="overhead-calibration steps (sleeps 0) per configuration")
    ap.add_argument("--repeats", type=int, default=1, help="timed steps per configuration")
    ap.add_argument("--quick", action="store_true", help="pp=2, m=4, one timed step, t_fwd=10 ms")
    ap.add_argument("--realtime", type=int, default=0, metavar="PRIO",
                    help="run the workers (and their gloo threads) under SCHED_FIFO with this priority (1-99), so "
                         "that other processes on a shared machine do not delay their wake-ups; 0: off")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    if a.t_fwd <= 0 or a.calib < 1 or a.repeats < 1:
        ap.error("--t-fwd must be > 0, --calib and --repeats >= 1")
    if a.quick:
        a.pp, a.microbatches, a.repeats, a.calib, a.t_fwd = [2], [4], 1, 1, 0.01
    cfg = dict(microbatches=a.microbatches, schedules=a.schedules, t_fwd=a.t_fwd, virtual=a.virtual,
               act_numel=a.act_numel, hidden=a.hidden, warmup=a.warmup, calib=a.calib, repeats=a.repeats,
               realtime=a.realtime)
    print(HEADER)
    print("|" + "---|" * (HEADER.count(" | ") + 1))
    results = []
    load_start = os.getloadavg()
    t_start = time.time()
    for p in a.pp:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            mp.spawn(_worker, args=(p, _free_port(), cfg, out), nprocs=p, join=True)
            with open(out) as f:
                results.extend(json.load(f))
    total = time.time() - t_start
    ok = [r for r in results if not r.get("error")]
    print(f"within {100 * TARGET:.0f}% of theory: {sum(r['within_target'] for r in ok)}/{len(ok)} "
          f"(failed: {len(results) - len(ok)}); total {total:.1f} s; load average (1/5/15 min) at start "
          f"{'/'.join(f'{x:.2f}' for x in load_start)}, at end {'/'.join(f'{x:.2f}' for x in os.getloadavg())}",
          file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(config=cfg, pp=a.pp, total_s=total, loadavg_start=load_start, loadavg_end=os.getloadavg(),
                           results=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
