"""Resuming mid-epoch with ``drop_last=False``: the padded tail must be the one the uninterrupted epoch pads with.

Hand-computed: 10 samples over 3 dp ranks, no shuffle. The epoch pads to 12 by wrapping to its start, giving the
order ``0..9, 0, 1``; rank r takes every 3rd index from r. A rank that stops after k samples has used
``consumed = 3k`` of the global order, and a resumed sampler must continue each rank's list exactly, whatever
part of the padding is still ahead (and with another number of dp ranks, the rest of the same padded order).
"""
from __future__ import annotations

import pytest
import torch

from oslo_models.data import CausalLMCollator, DistributedResumableSampler, build_dataloader

EPOCH = {0: [0, 3, 6, 9], 1: [1, 4, 7, 0], 2: [2, 5, 8, 1]}  # 10 samples, 3 dp ranks, padded with 0, 1


def _sampler(rank, size=3, n=10, **kw):
    return DistributedResumableSampler(n, dp_rank=rank, dp_size=size, drop_last=False, **kw)


def test_padded_epoch_from_the_start():
    assert {r: list(_sampler(r, shuffle=False)) for r in range(3)} == EPOCH


@pytest.mark.parametrize("used", [1, 2, 3])
def test_resume_mid_epoch_continues_every_rank_with_the_same_padding(used):
    for rank in range(3):
        first = _sampler(rank, shuffle=False)
        it = iter(first)
        head = [next(it) for _ in range(used)]
        state = first.state_dict()
        assert state["epoch"] == 0 and state["consumed"] == 3 * used
        resumed = _sampler(rank, shuffle=False)
        resumed.load_state_dict(state)
        assert len(resumed) == 4 - used
        assert head + list(resumed) == EPOCH[rank], (rank, used)
    done = _sampler(0, shuffle=False)
    it = iter(done)
    assert [next(it) for _ in range(4)] == EPOCH[0]  # stopped right after the last (padded) sample: next epoch
    assert done.state_dict() == {"epoch": 1, "consumed": 0, "seed": 0, "num_samples": 10, "shuffle": False}


def test_resume_on_other_dp_sizes_pads_the_rest_of_the_order():
    state = {"epoch": 0, "consumed": 6, "seed": 0, "num_samples": 10, "shuffle": False}
    # 4 left (6, 7, 8, 9): 4 ranks take one each; 5 ranks wrap once to the epoch start; 3 ranks pad with 0, 1.
    for size, expected in [(4, [[6], [7], [8], [9]]), (5, [[6], [7], [8], [9], [0]]), (3, [[6, 9], [7, 0], [8, 1]])]:
        got = []
        for rank in range(size):
            sampler = _sampler(rank, size, shuffle=False)
            sampler.load_state_dict(state)
            got.append(list(sampler))
        assert got == expected, size


def test_shuffled_resume_pads_from_the_shuffled_epoch_start():
    order = _sampler(0, seed=7).global_order(0).tolist()
    padded = order + order[:2]
    for rank in range(3):
        first = _sampler(rank, seed=7)
        it = iter(first)
        head = [next(it)]
        resumed = _sampler(rank, seed=7)
        resumed.load_state_dict(first.state_dict())
        assert head + list(resumed) == padded[rank::3]


class _Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"input_ids": torch.full((2,), i, dtype=torch.long)}


def test_loader_resume_mid_epoch_with_padding():
    # batch 2 per rank: rank r's epoch is two batches, EPOCH[r][:2] and EPOCH[r][2:]; stop after the first.
    def make(rank):
        return build_dataloader(_Ids(), batch_size=2, collator=CausalLMCollator(), dp_rank=rank, dp_size=3,
                                shuffle=False, drop_last=False)

    for rank in range(3):
        loader = make(rank)
        first = next(iter(loader))["input_ids"][:, 0].tolist()
        fresh = make(rank)
        fresh.load_state_dict(loader.state_dict())
        rest = [b["input_ids"][:, 0].tolist() for b in fresh]
        assert [first] + rest == [EPOCH[rank][:2], EPOCH[rank][2:]], rank
        assert fresh.state_dict()["epoch"] == 1
