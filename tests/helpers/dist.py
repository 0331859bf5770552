"""Run a test function in N gloo processes on CPU.

``run_distributed(fn, world_size, *args)`` sets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) in every child, so the library's "initialize from the torchrun environment" path is
what the tests exercise. ``fn`` must be a module-level function (it is pickled by name). A failure on any rank
fails the test with that rank's traceback. The ranks are long-lived spawned processes reused from call to call
(``tests/helpers/dist_pool.py``: the imports are paid once per pytest process, and each call starts from what a
fresh process would give it); ``OSLO_TEST_POOL=0`` spawns fresh ones every time.

A hang (a collective one rank never joins) fails after ``timeout`` seconds (default ``DEFAULT_TIMEOUT``: 150 s, or
``$OSLO_TEST_TIMEOUT``) instead of blocking CI: the error names the ranks still alive, the last ``breadcrumb`` each
of them left, and where each one was, as a Python stack of every thread (``faulthandler``, dumped on ``SIGUSR1``
just before the ranks are killed).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import dist_pool

# A deadlock must fail well under 3 minutes on the 2-core CI box (``pytest -n 2``). ``OSLO_TEST_TIMEOUT=<seconds>``
# raises it on a box shared with other jobs, where every test runs several times slower.
DEFAULT_TIMEOUT = float(os.environ.get("OSLO_TEST_TIMEOUT", 150.0))
_STACK_GRACE = 3.0  # seconds the ranks get to write their stacks before they are killed
_BREADCRUMB_ENV = "OSLO_TEST_BREADCRUMB"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def breadcrumb(text: str) -> None:
    """Record where this rank is (e.g. ``f"step {step}"``); a hang report prints each live rank's last one.

    Costs one small file write; a no-op outside ``run_distributed``."""
    path = os.environ.get(_BREADCRUMB_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)


def _enter_task(local_rank: int, world_size: int, port: int, report_dir: str):
    """The torchrun environment of one rank, and its stack file for the hang report (kept open while the task runs:
    faulthandler writes to the descriptor from its signal handler)."""
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    os.environ[_BREADCRUMB_ENV] = os.path.join(report_dir, f"rank{local_rank}.step")
    stacks = open(os.path.join(report_dir, f"rank{local_rank}.stack"), "w", encoding="utf-8")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(1)
    return stacks


def _child(local_rank: int, fn, world_size: int, port: int, args: tuple, report_dir: str) -> None:
    """A fresh spawned rank (``OSLO_TEST_POOL=0``)."""
    _enter_task(local_rank, world_size, port, report_dir)
    try:
        fn(*args)
    except BaseException:
        raise RuntimeError(f"rank {local_rank} failed:\n{traceback.format_exc()}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def hang_report(fn, world_size: int, timeout: float, processes, report_dir: str, alive: list[int] | None = None) -> str:
    """Ask every live rank (``alive``: default, every process still running) for its stacks, kill it, and
    describe who was where."""
    if alive is None:
        alive = [rank for rank, proc in enumerate(processes) if proc.is_alive()]
    for rank in alive:
        try:
            os.kill(processes[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _STACK_GRACE
    while time.monotonic() < deadline and not all(
            _read(os.path.join(report_dir, f"rank{rank}.stack")) for rank in alive):
        time.sleep(0.1)
    time.sleep(0.2)  # let the last lines land
    for rank in alive:
        processes[rank].kill()
    for proc in processes:
        proc.join(5)
    done = [rank for rank in range(world_size) if rank not in alive]
    lines = [f"distributed test {fn.__name__} (world {world_size}) hung for {timeout:.0f}s; "
             f"ranks still running: {alive}, finished: {done}"]
    for rank in alive:
        step = _read(os.path.join(report_dir, f"rank{rank}.step")) or "(no breadcrumb)"
        stack = _read(os.path.join(report_dir, f"rank{rank}.stack")) or "(no stack written)"
        lines.append(f"--- rank {rank}, last breadcrumb: {step}\n{stack}")
    return "\n".join(lines)


def run_distributed(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, fresh: bool = False) -> None:
    """Run ``fn(*args)`` on ``world_size`` spawned processes; raise if any rank fails or time runs out.

    A free port can be taken by another test process between ``free_port`` and rank 0's listen (pytest-xdist runs
    two at once): that one failure, before any test code ran, is retried once on a new port. ``fresh=True``: new
    processes for this call (a test that a pooled process's history was seen to disturb)."""
    try:
        _run_distributed(fn, world_size, args, timeout, fresh)
    except Exception as error:  # noqa: BLE001 - only the port race is retried
        if "EADDRINUSE" not in str(error):
            raise
        _run_distributed(fn, world_size, args, timeout, fresh)


def _run_distributed(fn, world_size: int, args: tuple, timeout: float, fresh: bool = False) -> None:
    port = free_port()
    if dist_pool.enabled() and not fresh:
        dist_pool.pool().run(fn, world_size, args, timeout, port)
        return
    with tempfile.TemporaryDirectory(prefix="oslo_dist_") as report_dir:
        ctx = mp.start_processes(_child, args=(fn, world_size, port, args, report_dir), nprocs=world_size,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(hang_report(fn, world_size, timeout, ctx.processes, report_dir))
