"""Long-lived rank processes for ``run_distributed``: spawn once, run many tests.

A spawned rank spends ~10 s of CPU importing torch, transformers and ``oslo_models`` before the test's first line;
the suite spawns a few hundred ranks, so on the 2-core CI box that import alone was a third of ``make test``. Each
pytest process therefore keeps a small pool of spawned processes (as many as the largest world it ran) and hands
each ``run_distributed`` call to the first ``world_size`` of them: rank ``r`` is worker ``r``, with the same
torchrun environment, breadcrumb and hang report as a fresh spawn.

What a fresh process would give a test is restored around every task: the environment variables and working
directory, a nondeterministic torch seed (as a fresh process has), default dtype, grad mode, one thread,
Accelerate's process-wide state; the default process group is destroyed and the collective watchdog stopped. A
worker that failed, hung, died, grew past ``_MAX_RSS`` or ran DTensor code (``_used_dtensor``) is replaced (the next
call starts a fresh one), so one broken test cannot leak into the next. ``OSLO_TEST_POOL=0`` spawns fresh processes
for every call instead (the old behaviour).

The workers are forked from one fork server per pytest process (``multiprocessing``'s ``forkserver``, which imports
``PRELOAD`` once and no more: no thread started, no process group, no DTensor cache), so replacing a worker costs a
fork instead of those imports; the suite replaces a whole world after every ZeRO-2/3 or FSDP test. A forked worker
takes the parent's environment of the moment it starts (as a spawned one inherits it), draws a fresh torch and numpy
seed per task, and shares the server's string hash seed (a spawned process draws its own);
``OSLO_TEST_POOL_FORK=0`` spawns the workers instead.
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

_MAX_RSS = 3 << 30  # a worker holding more than this after a task is replaced (bounds the pool's memory)
_MAX_TASKS = 60  # and so is one that ran this many (slow leaks: compiled graphs, caches)
# What the fork server imports once; a module left out is imported by each worker that needs it (slower only)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "numpy", "safetensors.torch", "transformers", "accelerate",
           "oslo_models", "oslo_models.training", "tests.helpers.dist", "tests.helpers.preload")
_START_LIMIT = 300.0  # seconds a cold worker may take to import the test before the call fails


def enabled() -> bool:
    return os.environ.get("OSLO_TEST_POOL", "1") != "0"


def _rss() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _used_dtensor() -> bool:
    """Whether the task ran DTensor code (FSDP2 / ZeRO-2/3, DTensor checkpoints): then the worker is not reused.
    torch caches DTensor placements and redistribution plans process-wide, keyed by mesh shape, and a later world
    of the same shape was seen to get the previous world's (destroyed) process groups back from them."""
    caches = []
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None:
        propagator = dtensor.DTensor._op_dispatcher.sharding_propagator
        caches += [getattr(propagator, name, None) for name in dir(propagator)]
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is not None:
        caches.append(getattr(redistribute, "_gen_transform_infos", None))
    info = [getattr(cache, "cache_info", None) for cache in caches]
    return any(callable(get) and get().currsize > 0 for get in info)


def _reset_process(environ: dict, cwd: str) -> bool:
    """Leave the process as the next task expects a fresh one; ``False`` when it cannot be reused."""
    if dist.is_initialized():
        dist.destroy_process_group()
    watchdog = sys.modules.get("oslo_models.distributed.watchdog")
    if watchdog is not None and watchdog.current_watchdog() is not None:
        watchdog.current_watchdog().stop()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    fresh = not _used_dtensor()
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:  # Accelerate's process-wide singletons (mixed precision, device mesh, ...)
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate_state.GradientState._reset_state()
    gc.collect()
    return fresh


def _serve(conn, environ: dict) -> None:
    """A pool worker: run tasks until the parent sends ``None`` or goes away. ``environ``: the parent's environment
    when it started this worker (what a spawned process inherits; a forked one has its fork server's)."""
    from tests.helpers.dist import _enter_task  # the same environment as a fresh spawn

    os.environ.clear()
    os.environ.update(environ)
    environ, cwd = dict(os.environ), os.getcwd()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        conn.send("started")  # the test module is imported (unpickling ``fn``): the parent's clock starts now
        fn, rank, world_size, port, args, report_dir = task
        stacks = _enter_task(rank, world_size, port, report_dir)
        torch.seed()  # a fresh process starts from a nondeterministic seed: so does every task
        if "numpy" in sys.modules:  # (Python's random is reseeded by the fork itself)
            sys.modules["numpy"].random.seed()
        error, clean = None, True
        try:
            fn(*args)
        except SystemExit as stop:
            if stop.code not in (None, 0):
                error = f"rank {rank} failed: SystemExit({stop.code!r})"
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            error = f"rank {rank} failed:\n{traceback.format_exc()}"
        try:
            clean = _reset_process(environ, cwd)
        except BaseException:  # noqa: BLE001 - a process that cannot be reset is not reused
            clean = False
            error = error or f"rank {rank} failed while cleaning up:\n{traceback.format_exc()}"
        stacks.close()
        conn.send((error, clean and _rss() < _MAX_RSS))


class _Worker:
    def __init__(self, context) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, dict(os.environ)), name="oslo-test-rank")
        self.process.start()
        child.close()
        self.tasks = 0
        self.reusable = True


class Pool:
    """The pool of one pytest process (``pool()``)."""

    def __init__(self) -> None:
        if os.environ.get("OSLO_TEST_POOL_FORK", "1") != "0":
            self._context = multiprocessing.get_context("forkserver")
            self._context.set_forkserver_preload(list(PRELOAD))
        else:
            self._context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []

    def _ready(self, world_size: int) -> list[_Worker]:
        self.workers = [w for w in self.workers if w.reusable and w.process.is_alive()]
        while len(self.workers) < world_size:
            self.workers.append(_Worker(self._context))
        return self.workers[:world_size]

    def discard(self, workers) -> None:
        for worker in workers:
            worker.reusable = False
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join(5)
            worker.conn.close()
        self.workers = [w for w in self.workers if w.reusable]

    def close(self) -> None:
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self.workers:
            worker.process.join(2)
            if worker.process.is_alive():
                worker.process.kill()
        self.workers = []

    def run(self, fn, world_size: int, args: tuple, timeout: float, port: int) -> None:
        from tests.helpers.dist import hang_report

        workers = self._ready(world_size)
        with tempfile.TemporaryDirectory(prefix="oslo_dist_") as report_dir:
            for rank, worker in enumerate(workers):
                worker.conn.send((fn, rank, world_size, port, args, report_dir))
                worker.tasks += 1
            pending, failures, started = set(range(world_size)), {}, set()
            # The hang clock starts once every rank has imported the test (a cold worker's imports take
            # 10-30 s on a loaded box); getting there has its own generous limit.
            deadline = time.monotonic() + max(timeout, _START_LIMIT)
            while pending and not failures:
                waitables = [workers[r].conn for r in pending] + [workers[r].process.sentinel for r in pending]
                multiprocessing.connection.wait(waitables, timeout=1.0)
                for rank in sorted(pending):
                    worker = workers[rank]
                    try:
                        message = worker.conn.recv() if worker.conn.poll() else None
                    except (EOFError, OSError):  # the worker is gone: judged by its exit code below
                        message, worker.reusable = None, False
                    if message is not None:
                        if message == "started":
                            started.add(rank)
                            if len(started) == world_size:
                                deadline = time.monotonic() + timeout
                            continue
                        error, reusable = message
                        pending.discard(rank)
                        worker.reusable = reusable and worker.tasks < _MAX_TASKS
                        if error:
                            failures[rank] = error
                    elif not worker.process.is_alive():
                        worker.process.join(1)
                        pending.discard(rank)
                        worker.reusable = False
                        if worker.process.exitcode != 0:  # a rank that ends its process with status 0 succeeded
                            failures[rank] = f"process {rank} terminated with exit code {worker.process.exitcode}"
                if pending and not failures and time.monotonic() > deadline:
                    processes = [w.process for w in workers]
                    report = hang_report(fn, world_size, timeout, processes, report_dir, alive=sorted(pending))
                    self.discard(workers)
                    raise TimeoutError(report)
        if failures:
            # The other ranks may wait in a collective the failed rank never joins: they are not reused.
            self.discard(workers)
            raise RuntimeError(failures[min(failures)])
        self.discard([worker for worker in workers if not worker.reusable])


_POOL: dict[str, Pool] = {}


def pool() -> Pool:
    """This pytest process's pool (created on first use, closed at exit)."""
    if "pool" not in _POOL:
        _POOL["pool"] = Pool()
        atexit.register(_POOL["pool"].close)
    return _POOL["pool"]
