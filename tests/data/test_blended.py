"""BlendedDataset: exact proportions overall and in every prefix, determinism, wrap-around, errors."""
from __future__ import annotations

import numpy as np
import pytest

from oslo_models.data import BlendedDataset, exact_counts


class Tagged:
    """A stand-in dataset whose item says where it came from."""

    def __init__(self, name, n):
        self.name, self.n = name, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return (self.name, i)


def test_exact_counts_sum_and_rounding():
    counts = exact_counts([0.7, 0.2, 0.1], 1001)
    assert counts.sum() == 1001
    assert counts.tolist() == [701, 200, 100]  # 700.7 -> 701 gets the leftover sample
    assert exact_counts([1, 1, 1], 10).tolist() == [4, 3, 3]


def test_proportions_exact_and_prefixes_balanced():
    dsets = [Tagged("a", 5000), Tagged("b", 5000), Tagged("c", 5000)]
    weights = [0.5, 0.3, 0.2]
    n = 9999
    mix = BlendedDataset(dsets, weights=weights, num_samples=n, seed=0)
    names = [mix[i][0] for i in range(n)]
    counts = [names.count(k) for k in "abc"]
    assert counts == exact_counts(weights, n).tolist() == [4999, 3000, 2000]  # remainders .5 .7 .8: b and c round up
    # every prefix stays within one sample (plus rounding) of its target mix
    onehot = np.array([[name == k for k in "abc"] for name in names], dtype=np.int64)
    prefix = np.cumsum(onehot, axis=0)
    target = np.arange(1, n + 1)[:, None] * np.array(weights)[None, :]
    assert np.abs(prefix - target).max() < 1.5
    # each member is read in its own order, each sample once
    b_idx = [mix[i][1] for i in range(n) if mix[i][0] == "b"]
    assert b_idx == list(range(3000))


def test_deterministic_by_seed():
    dsets = [Tagged("a", 100), Tagged("b", 100)]
    a = [BlendedDataset(dsets, [0.6, 0.4], 150, seed=1)[i] for i in range(150)]
    b = [BlendedDataset(dsets, [0.6, 0.4], 150, seed=1)[i] for i in range(150)]
    assert a == b
    orders = {tuple(BlendedDataset(dsets, [0.6, 0.4], 150, seed=s)[i] for i in range(150)) for s in range(10)}
    assert len(orders) > 1  # the seed moves the interleaving phase...
    assert all(sorted(o) == sorted(a) for o in orders)  # ...never the content


def test_small_dataset_wraps_around():
    mix = BlendedDataset([Tagged("a", 3), Tagged("b", 100)], [0.5, 0.5], num_samples=20)
    a_idx = [mix[i][1] for i in range(20) if mix[i][0] == "a"]
    assert a_idx == [0, 1, 2] * 3 + [0]


def test_default_num_samples_uses_each_member_at_most_once():
    mix = BlendedDataset([Tagged("a", 30), Tagged("b", 100)], [0.5, 0.5])
    assert len(mix) == 60 and mix.counts.tolist() == [30, 30]


def test_errors():
    with pytest.raises(ValueError, match="at least one"):
        BlendedDataset([], [], 10)
    with pytest.raises(ValueError, match="weights"):
        BlendedDataset([Tagged("a", 3)], [0.5, 0.5], 10)
    with pytest.raises(ValueError, match="positive"):
        BlendedDataset([Tagged("a", 3), Tagged("b", 3)], [1.0, -0.5], 10)
    with pytest.raises(ValueError, match="empty member"):
        BlendedDataset([Tagged("a", 0), Tagged("b", 3)], [1, 1], 10)
    with pytest.raises(IndexError):
        BlendedDataset([Tagged("a", 3)], [1.0], 5)[5]
