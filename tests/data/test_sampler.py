"""DistributedResumableSampler and build_dataloader: dp sharding, tp agreement, exact resume."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from oslo_models.data import CausalLMCollator, DistributedResumableSampler, build_dataloader


def ctx(dp_rank, dp_size, tp_rank=0, tp_size=1):
    return SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, tp_rank=tp_rank, tp_size=tp_size)


class Range(torch.utils.data.Dataset):
    """Sample i is a sequence that encodes i, so batches show which samples they hold."""

    def __init__(self, n, seq_len=4):
        self.n, self.seq_len = n, seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": torch.full((self.seq_len,), i, dtype=torch.long)}


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_disjoint_and_complete_over_dp_ranks(dp_size):
    n = 24
    shards = [list(DistributedResumableSampler(n, parallel_context=ctx(r, dp_size), seed=5)) for r in range(dp_size)]
    assert all(len(s) == n // dp_size for s in shards)
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n))  # complete, and disjoint (no repeats)
    assert flat != sorted(flat)  # shuffled


def test_uneven_tail_drop_or_pad():
    n, dp = 10, 3
    dropped = [list(DistributedResumableSampler(n, dp_rank=r, dp_size=dp, drop_last=True)) for r in range(dp)]
    assert [len(s) for s in dropped] == [3, 3, 3]
    assert len({i for s in dropped for i in s}) == 9
    padded = [list(DistributedResumableSampler(n, dp_rank=r, dp_size=dp, drop_last=False)) for r in range(dp)]
    assert [len(s) for s in padded] == [4, 4, 4]
    assert {i for s in padded for i in s} == set(range(n))


def test_identical_within_tp_group_and_explicit_ints_win():
    a = list(DistributedResumableSampler(50, parallel_context=ctx(1, 2, tp_rank=0, tp_size=4), seed=3))
    b = list(DistributedResumableSampler(50, parallel_context=ctx(1, 2, tp_rank=3, tp_size=4), seed=3))
    c = list(DistributedResumableSampler(50, parallel_context=ctx(0, 2), dp_rank=1, dp_size=2, seed=3))
    d = list(DistributedResumableSampler(50, parallel_context=ctx(0, 2), seed=3))
    assert a == b == c
    assert not set(a) & set(d)


def test_epochs_reshuffle_and_auto_advance():
    s = DistributedResumableSampler(30, dp_rank=0, dp_size=1, seed=0)
    e0, e1 = list(s), list(s)
    assert s.epoch == 2 and sorted(e0) == sorted(e1) == list(range(30)) and e0 != e1
    s.set_epoch(0)
    assert list(s) == e0


def test_sampler_state_resume_any_dp_size():
    n = 40
    full = DistributedResumableSampler(n, dp_rank=0, dp_size=1, seed=9).global_order(0).tolist()
    s = DistributedResumableSampler(n, dp_rank=1, dp_size=2, seed=9)
    it = iter(s)
    first = [next(it) for _ in range(5)]
    assert first == full[1:10:2]
    state = s.state_dict()
    assert state["epoch"] == 0 and state["consumed"] == 10
    # resume on 4 dp ranks: together they continue with exactly the rest of the global order
    resumed = []
    for r in range(4):
        t = DistributedResumableSampler(n, dp_rank=r, dp_size=4, seed=9)
        t.load_state_dict(state)
        resumed.append(list(t))
    assert sorted(i for part in resumed for i in part) == sorted(full[10:38])  # 30 left: 2 dropped on 4 ranks
    assert resumed[0][:2] == [full[10], full[14]]
    with pytest.raises(ValueError, match="seed"):
        DistributedResumableSampler(n, dp_rank=0, dp_size=1, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples"):
        DistributedResumableSampler(n + 1, dp_rank=0, dp_size=1, seed=9).load_state_dict(state)


def test_bad_ranks():
    with pytest.raises(ValueError, match="dp_rank"):
        DistributedResumableSampler(10, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="empty"):
        DistributedResumableSampler(0)


def _batches(loader, k=None):
    out = []
    for b in loader:
        out.append(b["input_ids"][:, 0].tolist())
        if k is not None and len(out) == k:
            break
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_gives_the_same_next_batches(num_workers):
    ds, bs = Range(50), 3
    make = lambda: build_dataloader(ds, batch_size=bs, collator=CausalLMCollator(), dp_rank=1, dp_size=2,  # noqa
                                    seed=4, num_workers=num_workers)
    reference = make()
    uninterrupted = _batches(reference) + _batches(reference)  # two epochs: 8 batches each (25 // 3)
    assert len(uninterrupted) == 16
    run = make()
    head = _batches(run, k=5)
    state = run.state_dict()
    assert state == {"epoch": 0, "consumed": 5 * bs * 2, "seed": 4, "num_samples": 50, "shuffle": True}
    fresh = make()
    fresh.load_state_dict(state)
    tail = _batches(fresh) + _batches(fresh)
    assert head + tail[:11] == uninterrupted
    # breaking out and iterating the same loader again continues too (prefetched batches are not lost)
    assert _batches(run)[:3] == uninterrupted[5:8]


def test_loader_state_at_epoch_end():
    loader = build_dataloader(Range(12), batch_size=2, collator=CausalLMCollator(), seed=0)
    _batches(loader)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["consumed"] == 0


def test_loader_tp_ranks_agree_and_split_sequence():
    ds = Range(16, seq_len=8)
    batches = [next(iter(build_dataloader(ds, batch_size=2, collator=CausalLMCollator(),
                                          parallel_context=ctx(0, 2, tp_rank=t, tp_size=2), split_sequence=True)))
               for t in range(2)]
    full = next(iter(build_dataloader(ds, batch_size=2, collator=CausalLMCollator(), parallel_context=ctx(0, 2))))
    for t, b in enumerate(batches):
        assert torch.equal(b["input_ids"], full["input_ids"][:, 4 * t:4 * t + 4])
        assert torch.equal(b["position_ids"], torch.arange(4 * t, 4 * t + 4).expand(2, 4))
        assert torch.equal(b["attention_mask"], full["attention_mask"])  # attention still sees the full sequence
    np.testing.assert_array_equal(batches[0]["input_ids"][:, 0], batches[1]["input_ids"][:, 0])
