"""A gloo world of forked ranks for the in-process fault checks (``test_worlds.py``), as ``run_distributed`` but
forked from the fault tests' server (``forkserver.py``: torch, transformers and ``oslo_models`` imported once)
instead of spawned (each spawned rank imports them anew, ~8 s of CPU).

    run(forkserver, "tests.faults.test_worlds:_world2", 2, [arg, ...], timeout=..., log_dir=...)

Every rank is ``python tests/faults/forkserver.py -m tests.faults.world TARGET ARGS_JSON`` with the torchrun
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so the library's "initialize
from the torchrun environment" path is what the checks exercise; ``TARGET(*ARGS)`` runs and the rank's exit status
says how it went. A rank that fails fails the call with every rank's output; a world still running after
``timeout`` seconds (a hang) is asked for every thread's stack (``faulthandler`` on SIGUSR1), killed, and the
stacks are the error.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.faults import forkserver as forkserver_module
from tests.faults import launch
from tests.helpers import examples
from tests.helpers.dist import free_port

STACK_GRACE = 3.0  # seconds the ranks get to write their stacks before they are killed


def run(forkserver: str, target: str, world_size: int, args: list, *, timeout: float, log_dir) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=examples.ROOT, PYTHONWARNINGS="ignore",
               WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), **{forkserver_module.ENV: forkserver})
    logs = [open(os.path.join(str(log_dir), f"rank{rank}.log"), "w+") for rank in range(world_size)]
    command = [sys.executable, forkserver_module.__file__, "-m", "tests.faults.world", target, json.dumps(args)]
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=examples.ROOT)
             for rank, log in enumerate(logs)]
    deadline = time.monotonic() + timeout
    hung = False
    while any(proc.poll() is None for proc in procs):
        if any(proc.returncode not in (None, 0) for proc in procs):
            time.sleep(STACK_GRACE)  # the others' own errors, if they have one, then stop them
            break
        if time.monotonic() > deadline:
            hung = True
            alive = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
            for rank in alive:
                procs[rank].send_signal(signal.SIGUSR1)  # forwarded to the rank: faulthandler dumps its stacks
            grace = time.monotonic() + STACK_GRACE
            while time.monotonic() < grace and not all(_stacks_written(logs[rank]) for rank in alive):
                time.sleep(0.05)
            time.sleep(0.2)  # the last lines
            break
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # the server kills the rank of a client that died
        proc.wait()
    outputs = launch.read_and_close(logs)
    codes = [proc.returncode for proc in procs]
    if hung or codes != [0] * world_size:
        what = f"hung for {timeout:.0f} s" if hung else f"failed: exit codes {codes}"
        raise AssertionError(f"{target} (world {world_size}) {what}\n" + "\n".join(
            f"--- rank {rank}\n{text[-6000:]}" for rank, text in enumerate(outputs)))


def _stacks_written(log) -> bool:
    log.flush()
    with open(log.name) as handle:
        return "most recent call first" in handle.read()


def main(target: str, payload: str) -> None:
    """In a rank: ``TARGET(*json.loads(payload))`` with stacks on SIGUSR1 and one intra-op thread."""
    import faulthandler
    import importlib

    import torch

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(*json.loads(payload))


if __name__ == "__main__":
    main(*sys.argv[1:3])
