"""torchrun jobs of the example scripts for the fault tests: one agent or two (``--nnodes 2`` over a loopback
rendezvous), a worker killed with SIGKILL at a chosen step, and the per-step losses of every attempt.

The losses come from ``OUTPUT/metrics.jsonl`` (``--report-to jsonl``: rank 0 appends one exact JSON line per
optimizer step); a restarted attempt appends again from its resumed step, so the file splits into attempts where
the step number goes back. Workers are found as the agent's child processes, their rank and attempt read from
their environment (``RANK``, ``TORCHELASTIC_RESTART_COUNT``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.helpers import examples

# Agents and workers run through fast_exit.py: the same programs, without ~2 s of CPU each for module teardown.
FAST_EXIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_exit.py")
TORCHRUN = [sys.executable, FAST_EXIT, "-m", "torch.distributed.run"]


def environment(tmp) -> dict:
    # matplotlib is not needed (loss.png is skipped) and costs every run a second of rank 0's time
    path = os.pathsep.join([examples.without_matplotlib(tmp), examples.ROOT])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONWARNINGS="ignore")


def agent(nproc: int, *, restarts: int = 0, nodes: int = 1, endpoint: str | None = None, host: bool = True):
    """The torchrun command line of one agent (before the script)."""
    command = [*TORCHRUN, "--nproc_per_node", str(nproc), "--max-restarts", str(restarts),
               "--monitor-interval", "0.2"]
    if nodes == 1:
        return command + ["--standalone"]
    return command + ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                      "--rdzv-id", "faults", "--rdzv-conf", f"is_host={int(host)}"]


def script(name: str, *args: str) -> list[str]:
    """The worker command after torchrun's options: ``examples/NAME ARGS`` run through ``fast_exit.py``."""
    return [FAST_EXIT, os.path.join(examples.EXAMPLES, name), *args]


def attempts(out) -> list[dict[int, float]]:
    """Per attempt, ``{step: loss}`` from ``metrics.jsonl``."""
    path = os.path.join(out, "metrics.jsonl")
    found: list[dict[int, float]] = []
    last = None
    for line in open(path).read().splitlines() if os.path.exists(path) else []:
        entry = json.loads(line)
        if "train/loss" not in entry:
            continue
        if last is None or entry["step"] <= last:
            found.append({})
        found[-1][entry["step"]] = entry["train/loss"]
        last = entry["step"]
    return found


def workers(agent_pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the agent's workers of its current attempt."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            if parent != agent_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as handle:
                env = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry)
    return found


def run(commands: list[list[str]], env: dict, log_dir, *, timeout: float = 400, kill=None,
        expect_success: bool = True) -> tuple[list[str], str | None]:
    """Run one job of ``len(commands)`` agents to the end; returns ``(each agent's output, latest at the kill)``.

    ``kill``: ``(out, step, victim_rank)``: once ``out/metrics.jsonl`` logs ``step``, the rank-0 worker is
    stopped (so no further step or save completes), the ``victim_rank`` worker killed with SIGKILL, and rank 0
    continued: the agents see a worker die mid-run. The name ``out/checkpoint/latest`` held at that instant is
    returned. ``expect_success``: every agent exits 0 (else: at least one does not)."""
    latest_at_kill = None
    logs = [open(os.path.join(log_dir, f"agent{i}.log"), "w+") for i in range(len(commands))]
    procs = [subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=examples.ROOT)
             for command, log in zip(commands, logs)]
    deadline = time.monotonic() + timeout
    try:
        if kill is not None:
            out, step, victim = kill
            while not any(step in attempt for attempt in attempts(out)):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise AssertionError(f"step {step} never logged:\n" + _tail(logs))
                time.sleep(0.02)
            pids = {}
            for proc in procs:
                pids.update(workers(proc.pid))
            os.kill(pids[0], signal.SIGSTOP)
            latest = os.path.join(out, "checkpoint", "latest")
            latest_at_kill = open(latest).read().strip() if os.path.exists(latest) else None
            os.kill(pids[victim], signal.SIGKILL)
            os.kill(pids[0], signal.SIGCONT)
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        raise
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [proc.returncode for proc in procs]
    assert (codes == [0] * len(procs)) == expect_success, f"exit codes {codes}\n" + "\n".join(
        text[-4000:] for text in outputs)
    return outputs, latest_at_kill


def _tail(logs) -> str:
    text = []
    for log in logs:
        log.flush()
        log.seek(0)
        text.append(log.read()[-3000:])
    return "\n".join(text)
