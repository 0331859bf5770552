"""A rank that stops participating (SIGSTOP) makes every other rank fail within ``collective_timeout`` plus a few
seconds, with an error naming the group, the operation and the missing rank; without the timeout they hang.

World 4 = tp 2 x dp 2 (ranks 2 and 3 hold replica 1). Rank 3 stops itself just before a training step. Rank 2, its
tensor-parallel peer, waits in the forward's all-reduce over ``tp``; ranks 0 and 1 finish their forward/backward
and wait in the gradient all-reduce over ``dp``: rank 1 for rank 3 (stopped), rank 0 for rank 2 (alive, but itself
waiting in ``tp``). Every one of them must fail with a report saying exactly that. Then the negative control: the
same stop under ``collective_timeout=None`` (the backend's 30-minute default) leaves rank 2 blocked past where the
watchdog would have failed it; the rank is released (SIGCONT) and the collective completes, which shows the test
would see a hang. ``world4`` runs last in the spawned world of 4 of ``test_worlds.py``.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import torch
import torch.distributed as dist

import oslo_models as om
from oslo_models.distributed import watchdog as watchdog_module
from tests.helpers.models import tiny_gpt2_config

TIMEOUT = 5.0  # seconds; heartbeats every 0.625 s, a heartbeat 2.4 s old means stopped
SLACK = 12.0  # the rank's own timing on a loaded 2-core box: entering late, the report, the backend's raise


def _step(model, ids):
    """Forward + backward (all-reduces over tp), then the data-parallel gradient all-reduce over dp."""
    model(ids, labels=ids).loss.backward()
    context = model.parallel_context
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    dist.all_reduce(grads, group=context.dp_group)


def world4():
    rank = dist.get_rank()
    previous = watchdog_module.current_watchdog()
    if previous is not None:  # one started by the earlier checks, at their timeout: this check starts its own
        previous.stop()
    pids = [None] * 4
    dist.all_gather_object(pids, os.getpid())
    torch.manual_seed(0)
    config = om.ParallelConfig(tensor_parallel_size=2, collective_timeout=TIMEOUT)
    model = om.AutoModelForCausalLM.from_config(tiny_gpt2_config(), parallel=config)
    om.distributed.mark_gradients_reduced(model, "caller")  # _step all-reduces the gradients over dp itself
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(rank // 2))
    _step(model, ids)  # everyone healthy: one full step
    dist.barrier()

    if rank == 3:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no collective, no heartbeat, until a peer continues it
    else:
        start = time.monotonic()
        try:
            _step(model, ids)
            raise AssertionError(f"rank {rank}: the step finished although rank 3 is stopped")
        except RuntimeError as error:
            elapsed = time.monotonic() - start
            raw = str(error)
            try:
                watchdog_module.raise_for_timeout(error)
                raise AssertionError(f"rank {rank}: no report for {raw!r}")
            except watchdog_module.CollectiveTimeoutError as clear:
                report = str(clear)
        assert elapsed < TIMEOUT + SLACK, (rank, elapsed, report)
        assert elapsed >= TIMEOUT, (rank, elapsed, report)
        expected = {
            2: r"waited [\d.]+ s in all_reduce #\d+ of process group 'tp' \(ranks \[2, 3\]\); missing: rank 3 on .* "
               r"\(no heartbeat for [\d.]+ s: stopped",
            1: r"in all_reduce #\d+ of process group 'dp' \(ranks \[1, 3\]\); missing: rank 3 .*no heartbeat",
            0: r"in all_reduce #\d+ of process group 'dp' \(ranks \[0, 2\]\); missing: rank 2 .*\(alive, but has not "
               r"entered it: it waits in all_reduce #\d+ of group 'tp' \(ranks \[2, 3\]\)",
        }[rank]
        assert re.search(expected, report), (rank, report)
        assert "collective_timeout=5 s" in report, report
        # negative control of the message: the backend's own error names no group and no rank
        assert "rank 3" not in raw and "'tp'" not in raw and "'dp'" not in raw, raw
        if rank == 0:
            time.sleep(0.5)
            os.kill(pids[3], signal.SIGCONT)  # rank 3 goes on without the step (its peers have given up)

    # Negative control: no collective_timeout -> the backend waits its default 30 minutes: a hang.
    watchdog_module.current_watchdog().stop()
    quiet = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=2, collective_timeout=None))
    dist.barrier(group=quiet.tp_group)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 2:
        released = threading.Event()

        waited_for = TIMEOUT + watchdog_module.grace_for(TIMEOUT) + 2.0  # past where the watchdog would have failed

        def release():  # then continue rank 3
            if not released.wait(waited_for):
                os.kill(pids[3], signal.SIGCONT)

        threading.Thread(target=release, daemon=True).start()
        start = time.monotonic()
        ping = torch.ones(1)
        dist.all_reduce(ping, group=quiet.tp_group)  # waits for rank 3; the backend never gives up on its own
        released.set()
        waited = time.monotonic() - start
        assert waited >= waited_for, f"the unguarded collective returned after {waited:.1f} s: no hang to catch"
    if rank == 3:
        dist.all_reduce(torch.ones(1), group=quiet.tp_group)

