"""torchrun jobs of the example scripts for the fault tests: one agent or two (``--nnodes 2`` over a loopback
rendezvous), a worker killed with SIGKILL at a chosen step, and the per-step losses of every attempt.

The losses come from ``OUTPUT/metrics.jsonl`` (``--report-to jsonl``: rank 0 appends one exact JSON line per
optimizer step); a restarted attempt appends again from its resumed step, so the file splits into attempts where
the step number goes back. Workers are found as the agent's child processes, their rank read from their environment
(``RANK``). The workers are forked from a server that has imported torch once (``forkserver.py``; the agent's
children stand in for them); ``OSLO_FAULT_FORKSERVER=0`` runs each in a fresh interpreter instead.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.faults import forkserver as forkserver_module
from tests.helpers import examples

HERE = os.path.dirname(os.path.abspath(__file__))
# Agents and workers start through forkserver.py: forked from a process that imported torch once, or (without a
# server) in a fresh interpreter through fast_exit.py, without ~2 s of CPU each for module teardown.
FORKSERVER = os.path.join(HERE, "forkserver.py")
TORCHRUN = [sys.executable, FORKSERVER, "-m", "torch.distributed.run"]


def environment(tmp, forkserver: str = "0") -> dict:
    """The jobs' environment; ``forkserver``: the address of a :class:`ForkServer` ("0": fresh interpreters)."""
    # matplotlib is not needed (loss.png is skipped) and costs every run a second of rank 0's time
    path = os.pathsep.join([examples.without_matplotlib(tmp), examples.ROOT])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONWARNINGS="ignore",
                **{forkserver_module.ENV: forkserver})


class ForkServer:
    """``forkserver.py --serve`` for the duration of a ``with`` block (the ``address`` its clients connect to)."""

    def __init__(self, tmp, timeout: float = 300):
        self.address = os.path.join(str(tmp), "forkserver.sock")
        self.log = open(os.path.join(str(tmp), "forkserver.log"), "w+")
        env = environment(tmp)
        env.pop("PYTHONUNBUFFERED", None)  # each child takes its client's buffering (test_forkserver checks it)
        self.proc = subprocess.Popen([sys.executable, FORKSERVER, "--serve", self.address], env=env,
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=examples.ROOT)
        self.timeout = timeout

    def __enter__(self) -> str:
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(self.address):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise AssertionError("the fork server did not start:\n" + _tail([self.log]))
            time.sleep(0.05)
        return self.address

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()  # the server's cue to kill what is left and go
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def agent(nproc: int, *, restarts: int = 0, nodes: int = 1, endpoint: str | None = None, host: bool = True):
    """The torchrun command line of one agent (before the script)."""
    command = [*TORCHRUN, "--nproc_per_node", str(nproc), "--max-restarts", str(restarts),
               "--monitor-interval", "0.2"]
    if nodes == 1:
        return command + ["--standalone"]
    return command + ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                      "--rdzv-id", "faults", "--rdzv-conf", f"is_host={int(host)}"]


def script(name: str, *args: str) -> list[str]:
    """The worker command after torchrun's options: ``examples/NAME ARGS`` run through ``forkserver.py``."""
    return [FORKSERVER, os.path.join(examples.EXAMPLES, name), *args]


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
    """``{rank: pid}`` of the agent's workers of its current attempt (forked ones: the process the server forked
    for the agent's child, see ``forkserver.py``)."""
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
            found[int(env[b"RANK"])] = forked(int(entry), env.get(forkserver_module.ENV.encode(), b"0").decode())
    return found


def forked(pid: int, server: str) -> int:
    """The process that runs the program of the ``forkserver.py`` client ``pid`` (itself without a server)."""
    if server == "0":
        return pid
    mapping = os.path.join(server + ".pids", str(pid))
    deadline = time.monotonic() + 60
    while not os.path.exists(mapping):  # written as the server forks the client's program
        assert time.monotonic() < deadline, f"nothing forked for client {pid}"
        time.sleep(0.01)
    return int(open(mapping).read())


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
                pids.update(workers(forked(proc.pid, env[forkserver_module.ENV])))
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
    outputs = read_and_close(logs)
    codes = [proc.returncode for proc in procs]
    assert (codes == [0] * len(procs)) == expect_success, f"exit codes {codes}\n" + "\n".join(
        text[-4000:] for text in outputs)
    return outputs, latest_at_kill


def read_and_close(logs) -> list[str]:
    """The whole text of each log file (opened ``w+``), then closed."""
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return outputs


def _tail(logs) -> str:
    text = []
    for log in logs:
        log.flush()
        log.seek(0)
        text.append(log.read()[-3000:])
    return "\n".join(text)
