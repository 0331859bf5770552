"""``run_distributed`` turns a deadlock into a fast failure that says which ranks hung and where."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import DEFAULT_TIMEOUT, breadcrumb, run_distributed


def _deadlock_worker() -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 0:
        breadcrumb("step 2: all_reduce of the loss")
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        breadcrumb("step 2: sleeping instead")
        time.sleep(600)


def test_a_deadlock_fails_fast_and_reports_ranks_and_stacks():
    assert DEFAULT_TIMEOUT <= 150 or "OSLO_TEST_TIMEOUT" in os.environ  # well under 3 minutes on CI
    timeout = round(max(15.0, DEFAULT_TIMEOUT / 10))  # both ranks must reach the deadlock first (longer when loaded)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_distributed(_deadlock_worker, 2, timeout=timeout)
    assert time.monotonic() - start < timeout + 30
    report = str(info.value)
    assert f"_deadlock_worker (world 2) hung for {timeout}s; ranks still running: [0, 1], finished: []" in report
    rank0, rank1 = report.split("--- rank 0, ")[1].split("--- rank 1, ")
    assert rank0.startswith("last breadcrumb: step 2: all_reduce of the loss"), report
    assert "in all_reduce" in rank0 and "in _deadlock_worker" in rank0  # where rank 0 waits
    assert rank1.startswith("last breadcrumb: step 2: sleeping instead") and "in _deadlock_worker" in rank1
