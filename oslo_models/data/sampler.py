"""A data-parallel, resumable sampler.

Every rank builds the same global order for an epoch (a permutation drawn from ``(seed, epoch)``), and dp rank
``r`` of ``R`` takes every ``R``-th index of what is left of it, starting at ``r``. Ranks of one tensor/pipeline
group share a dp rank and so get the same indices; different dp ranks get disjoint ones. The state is two numbers,
``epoch`` and ``consumed`` (samples of the global order used so far by all dp ranks together), so a run resumes with
exactly the next sample, even with a different number of dp ranks.
"""
from __future__ import annotations

import numpy as np
import torch


def resolve_dp(parallel_context=None, dp_rank=None, dp_size=None) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` from explicit ints, else from ``parallel_context.dp_rank/.dp_size``, else ``(0, 1)``."""
    if dp_rank is None and parallel_context is not None:
        dp_rank = parallel_context.dp_rank
    if dp_size is None and parallel_context is not None:
        dp_size = parallel_context.dp_size
    dp_rank = 0 if dp_rank is None else int(dp_rank)
    dp_size = 1 if dp_size is None else int(dp_size)
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    return dp_rank, dp_size


class DistributedResumableSampler(torch.utils.data.Sampler):
    """Yields this dp rank's sample indices (ints) for the current epoch, from where the last run stopped.

    Args:
        dataset: anything with ``len()`` (or an int: the number of samples).
        parallel_context: any object with ``dp_rank`` and ``dp_size`` (tp/pp ranks are ignored on purpose: the
            ranks of one model replica must read the same batch). Explicit ``dp_rank``/``dp_size`` win over it.
        shuffle: permute indices per epoch with ``numpy.random.default_rng([seed, epoch])``.
        drop_last: drop the tail that does not divide evenly over dp ranks (each rank yields
            ``floor(remaining / dp_size)``); otherwise pad it by wrapping to the epoch start, as
            ``torch.utils.data.DistributedSampler`` does, so every rank yields ``ceil(remaining / dp_size)``.

    An epoch that is iterated to the end moves the sampler to the next epoch. ``state_dict()`` counts the indices
    this iterator has yielded, which is exact for ``num_workers=0``; with worker processes the loader prefetches
    ahead, so use the state of :class:`~oslo_models.data.loader.ResumableDataLoader`, which counts delivered batches.
    """

    def __init__(self, dataset, *, parallel_context=None, dp_rank: int | None = None, dp_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        self.num_samples = int(dataset) if isinstance(dataset, (int, np.integer)) else len(dataset)
        if self.num_samples <= 0:
            raise ValueError("the dataset is empty")
        self.dp_rank, self.dp_size = resolve_dp(parallel_context, dp_rank, dp_size)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self.consumed = 0  # of the global order of self.epoch, at the start of the current iteration
        self._yielded = 0  # by this rank in the current iteration

    def global_order(self, epoch: int) -> np.ndarray:
        """The order all ranks share in ``epoch`` (int ``[num_samples]``)."""
        dtype = np.int32 if self.num_samples < 2**31 else np.int64
        order = np.arange(self.num_samples, dtype=dtype)
        if self.shuffle:
            np.random.default_rng([self.seed, int(epoch)]).shuffle(order)
        return order

    def _local_count(self, consumed: int) -> int:
        remaining = self.num_samples - consumed
        return remaining // self.dp_size if self.drop_last else -(-remaining // self.dp_size)

    def __len__(self) -> int:
        return self._local_count(self.consumed)

    def __iter__(self):
        order = self.global_order(self.epoch)
        rest = order[self.consumed:]
        count = self._local_count(self.consumed)
        need = count * self.dp_size
        if need > rest.size:  # pad by wrapping around the epoch's order (only when not drop_last)
            rest = np.concatenate([rest, np.resize(order, need - rest.size)])
        mine = rest[self.dp_rank:need:self.dp_size]
        self._yielded = 0
        for index in mine:
            self._yielded += 1
            yield int(index)
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (like ``DistributedSampler.set_epoch``)."""
        self.epoch, self.consumed, self._yielded = int(epoch), 0, 0

    def state_dict(self, num_local_consumed: int | None = None) -> dict:
        """``{"epoch", "consumed", "seed", "num_samples", "shuffle"}``.

        ``num_local_consumed``: samples this rank has really used in the current iteration (default: yielded).
        """
        local = self._yielded if num_local_consumed is None else int(num_local_consumed)
        return self.state_at(self.epoch, self.consumed, local)

    def state_at(self, epoch: int, start: int, num_local_consumed: int) -> dict:
        """The state after this rank used ``num_local_consumed`` samples of an iteration that began at
        ``(epoch, start)``."""
        consumed = start + num_local_consumed * self.dp_size
        if num_local_consumed >= self._local_count(start):  # this epoch's share is used up: next epoch, from 0
            epoch, consumed = epoch + 1, 0
        return {"epoch": int(epoch), "consumed": int(consumed), "seed": self.seed,
                "num_samples": self.num_samples, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; ``ValueError`` if it belongs to another dataset size, seed or shuffle mode."""
        for key in ("seed", "num_samples", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has "
                                 f"{key}={getattr(self, key)!r}; it belongs to another run")
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(f"consumed={consumed} is outside [0, {self.num_samples}]")
        self.epoch, self.consumed, self._yielded = int(state["epoch"]), consumed, 0
