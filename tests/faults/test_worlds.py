"""The in-process fault checks, in two gloo worlds instead of one per check, their ranks forked from the fault tests'
server (``world.py``, ``forkserver.py``): a spawned rank costs ~8 s of CPU to import torch and transformers, the
checks themselves a fraction of that.

- world 2: every rank gets the same error at tp 2 and pp 2 (``rank_agreement.world2``), then a full disk at every
  write of a save, a corrupt checkpoint on resume and a NaN on one rank (``checkpoint_faults.world2``), and the
  examples' elastic-restart count agreed over the ranks (:func:`_restart_count_agreed`);
- world 4: the same error at pp 2 x tp 2 (``rank_agreement.world4``), then a rank stopped with SIGSTOP in a
  collective (``stuck_peer.world4``): last, because it leaves timed-out collectives behind.

Each part checks its own negative controls (see those modules); they share nothing but the process group (each
makes its own models, folders and, for the stopped rank, its own watchdog).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.faults import checkpoint_faults, rank_agreement, stuck_peer, world
from tests.helpers import examples


def _leave() -> None:
    """Every rank done: leave without the interpreter's module teardown (~2 s of CPU per rank, see fast_exit.py).
    The barrier has a timeout of its own: the stopped-rank check left the world group at its 7 s backend timeout,
    and ranks 2 and 3 still run their negative control (9 s) when ranks 0 and 1 get here."""
    dist.monitored_barrier(timeout=timedelta(seconds=120))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _restart_count_agreed():
    """Two nodes after an elastic restart: rank 1's agent counted the restart, rank 0's restarted its healthy
    workers as a membership change, which torchrun does not count. The examples resume on every rank (negative
    control: what each rank reads from its environment disagrees, and rank 0 alone would start fresh)."""
    sys.path.insert(0, examples.EXAMPLES)
    import _common

    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(dist.get_rank())
    read = [None] * 2
    dist.all_gather_object(read, int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
    assert read == [0, 1], read
    assert _common.elastic_restart() == 1
    del os.environ["TORCHELASTIC_RESTART_COUNT"]
    sys.path.remove(examples.EXAMPLES)


def _world2(paths, tmp):
    dist.init_process_group("gloo")  # the library joins an initialized group; the checks need one at once
    rank_agreement.world2(paths)
    checkpoint_faults.world2(tmp)
    _restart_count_agreed()
    _leave()


def _world4(paths):
    dist.init_process_group("gloo")
    rank_agreement.world4(paths)
    stuck_peer.world4()
    _leave()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return rank_agreement.checkpoints(tmp_path_factory.mktemp("agreement"))


def test_world2_rank_agreement_full_disk_corrupt_checkpoint_nan_on_one_rank(forkserver, paths, tmp_path):
    world.run(forkserver, f"{__name__}:_world2", 2, [paths, str(tmp_path)], timeout=360, log_dir=tmp_path)


def test_world4_rank_agreement_then_a_stopped_rank(forkserver, paths, tmp_path):
    world.run(forkserver, f"{__name__}:_world4", 4, [paths], timeout=360, log_dir=tmp_path)
