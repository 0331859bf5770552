"""Spawn N gloo processes on CPU and run a test function in each.

``run_distributed(fn, world_size, *args)`` sets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) in every child, so the library's "initialize from the torchrun environment" path is
what the tests exercise. ``fn`` must be a module-level function (it is pickled by name). A failure on any rank
fails the test with that rank's traceback; a hang fails after ``timeout`` seconds instead of blocking CI.
"""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(local_rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        fn(*args)
    except BaseException:
        raise RuntimeError(f"rank {local_rank} failed:\n{traceback.format_exc()}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0) -> None:
    """Run ``fn(*args)`` on ``world_size`` spawned processes; raise if any rank fails or time runs out."""
    port = free_port()
    ctx = mp.start_processes(_child, args=(fn, world_size, port, args), nprocs=world_size,
                             join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            raise TimeoutError(f"distributed test {fn.__name__} (world {world_size}) hung for {timeout:.0f}s")
