"""``build_dataloader``: a ``torch.utils.data.DataLoader`` over this dp rank's share, resumable mid-epoch."""
from __future__ import annotations

import torch
from torch.utils.data import default_collate

from .collators.context_parallel import ContextParallelSplitter
from .collators.splitter import SequenceParallelSplitter
from .sampler import DistributedResumableSampler


class ResumableDataLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` driven by a :class:`DistributedResumableSampler` that knows how far training got.

    It counts the batches it has handed out (not the indices its workers prefetched), so ``state_dict()`` taken
    after ``k`` batches and given to ``load_state_dict()`` of a fresh loader makes that loader continue with batch
    ``k + 1`` of the same epoch, whatever ``num_workers`` is. Breaking out of a loop and iterating again also
    continues where the last delivered batch stopped. Batches are ``batch_size`` samples per dp rank.
    """

    def __init__(self, dataset, *, sampler: DistributedResumableSampler, batch_size: int, **kwargs):
        # Every new iterator draws a worker base seed from `generator`; torch's default is the *global* RNG,
        # which would shift dropout masks depending on when iteration (re)starts: a resumed run would then
        # differ from an uninterrupted one. A private generator keeps the global stream for the model.
        kwargs.setdefault("generator", torch.Generator().manual_seed(sampler.seed))
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._progress: list | None = None  # [epoch, start consumed, batches delivered] of an unfinished pass

    def __iter__(self):
        if self._progress is not None:  # a pass was abandoned: resume it from the last batch handed out
            self.sampler.load_state_dict(self.state_dict())
        progress = [self.sampler.epoch, self.sampler.consumed, 0]
        self._progress = progress
        for batch in super().__iter__():
            progress[2] += 1
            yield batch
        if self._progress is progress:
            self._progress = None

    def state_dict(self) -> dict:
        """Sampler state after the batches delivered so far (see ``DistributedResumableSampler.state_dict``)."""
        if self._progress is None:
            return self.sampler.state_dict(num_local_consumed=0)
        epoch, start, batches = self._progress
        return self.sampler.state_at(epoch, start, batches * self.batch_size)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._progress = None


def build_dataloader(dataset, batch_size: int, collator=None, *, parallel_context=None, dp_rank: int | None = None,
                     dp_size: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                     split_sequence: bool = False, split_context: bool | None = None, shift_labels: bool = True,
                     num_workers: int = 0, pin_memory: bool = False,
                     **dataloader_kwargs) -> ResumableDataLoader:
    """A resumable loader yielding this dp rank's batches of ``batch_size`` samples (per rank).

    Args:
        collator: turns a list of samples into a dict of tensors (e.g. :class:`CausalLMCollator`); default
            ``torch.utils.data.default_collate``.
        parallel_context: any object with ``dp_rank``/``dp_size`` (and ``tp_rank``/``tp_size`` when
            ``split_sequence``); explicit ``dp_rank``/``dp_size`` override it. Every tensor/pipeline rank of one
            replica gets the same batches, different dp ranks disjoint ones.
        split_sequence: give tp rank ``r`` only its contiguous ``1/tp_size`` slice of the sequence dimension
            (:class:`SequenceParallelSplitter`, for Megatron-style sequence parallelism).
        split_context: give cp rank ``r`` its chunk(s) of every sequence (:class:`ContextParallelSplitter`);
            default: on when ``parallel_context.cp_size > 1``. ``shift_labels`` (causal LMs; ``False`` for MLM):
            targets shifted on the full sequence before the split.
        drop_last: drop incomplete batches (and the indices that do not divide over dp ranks), so every rank
            runs the same number of equal steps.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    sampler = DistributedResumableSampler(dataset, parallel_context=parallel_context, dp_rank=dp_rank,
                                          dp_size=dp_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
    collate = collator if collator is not None else default_collate
    if split_context is None:
        split_context = getattr(parallel_context, "cp_size", 1) > 1
    if split_context:
        collate = _SplitAfter(collate, ContextParallelSplitter(parallel_context, shift_labels=shift_labels))
    if split_sequence:
        collate = _SplitAfter(collate, SequenceParallelSplitter(parallel_context=parallel_context))
    return ResumableDataLoader(dataset, sampler=sampler, batch_size=batch_size, collate_fn=collate,
                               drop_last=drop_last, num_workers=num_workers, pin_memory=pin_memory,
                               **dataloader_kwargs)


class _SplitAfter:
    """Collate, then keep this tp rank's sequence slice (a class, not a lambda, so workers can pickle it)."""

    def __init__(self, collate, splitter):
        self.collate, self.splitter = collate, splitter

    def __call__(self, examples):
        return self.splitter(self.collate(examples))
