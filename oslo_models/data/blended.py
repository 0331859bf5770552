"""Mix several datasets by weight with exact proportions and a deterministic order."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def exact_counts(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """Split ``num_samples`` into integer counts proportional to ``weights`` (largest-remainder method).

    The counts sum to ``num_samples`` exactly and each is ``floor`` or ``ceil`` of ``weight * num_samples``.
    """
    w = np.asarray(weights, dtype=np.float64)
    ideal = w / w.sum() * num_samples
    counts = np.floor(ideal).astype(np.int64)
    short = num_samples - int(counts.sum())
    # ties broken by dataset order (stable sort) so the result does not depend on float noise in the seed
    counts[np.argsort(-(ideal - counts), kind="stable")[:short]] += 1
    return counts


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights``.

    Dataset ``k`` contributes exactly ``exact_counts(weights, num_samples)[k]`` samples, spread evenly over the
    blend: sample ``j`` of dataset ``k`` is placed at ideal time ``(j + u_k) / count_k`` with a phase ``u_k`` drawn
    from ``seed``, and the blend is the stable sort of those times. Every prefix of the blend is therefore within
    one sample per dataset of its target mix, not only the whole. Dataset ``k`` is read in its own order
    (``ds_k[j % len(ds_k)]``; it wraps around, i.e. repeats epochs, when it is asked for more samples than it has),
    so shuffling belongs to the member datasets (e.g. :class:`PackedCausalLMDataset`'s ``seed``).

    ``ds[i]`` returns the member's item unchanged. ``dataset_index[i]`` / ``sample_index[i]`` tell where it came
    from. ``num_samples`` defaults to the largest blend in which no member repeats.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int | None = None, *,
                 seed: int = 0):
        if len(datasets) == 0:
            raise ValueError("BlendedDataset needs at least one dataset")
        if len(weights) != len(datasets):
            raise ValueError(f"{len(weights)} weights for {len(datasets)} datasets")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"weights must be positive and finite, got {list(weights)}")
        w = w / w.sum()
        sizes = np.array([len(d) for d in datasets], dtype=np.int64)
        if np.any(sizes == 0):
            raise ValueError(f"empty member dataset(s) at positions {np.flatnonzero(sizes == 0).tolist()}")
        if num_samples is None:
            num_samples = int(np.floor(np.min(sizes / w)))
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.datasets = list(datasets)
        self.weights = w
        self.num_samples = int(num_samples)
        self.counts = exact_counts(w, self.num_samples)
        rng = np.random.default_rng([int(seed), 2])
        phase = rng.random(len(datasets))
        keys = np.concatenate([(np.arange(c) + phase[k]) / c for k, c in enumerate(self.counts) if c > 0])
        owner = np.concatenate([np.full(c, k, dtype=np.int32) for k, c in enumerate(self.counts) if c > 0])
        rank = np.concatenate([np.arange(c, dtype=np.int64) for c in self.counts if c > 0])
        order = np.argsort(keys, kind="stable")
        self.dataset_index = owner[order]
        self.sample_index = rank[order] % sizes[self.dataset_index]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        k = int(self.dataset_index[i])
        return self.datasets[k][int(self.sample_index[i])]

    def __repr__(self) -> str:
        return f"BlendedDataset({len(self.datasets)} datasets, counts={self.counts.tolist()})"
