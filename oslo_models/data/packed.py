"""Fixed-length causal-LM samples packed across document boundaries of a ``.bin/.idx`` corpus.

The token stream of epoch ``e`` is every document once, in an order shuffled by ``(seed, e)``; the epochs are
concatenated and cut into consecutive, non-overlapping windows of ``seq_len`` tokens (the tail shorter than
``seq_len`` is dropped). The windows are then shuffled by ``seed``. Labels are the inputs themselves: Hugging Face
models shift them inside the loss, so no token is duplicated between samples and concatenating the samples in stream
order gives the token stream back exactly.

Three small numpy arrays locate everything (the Megatron-LM layout, built here with vectorized numpy):

- ``doc_idx``     ``[E*D]``  document ids in stream order,
- ``sample_idx``  ``[S, 2]`` (position in ``doc_idx``, token offset in that document) where sample ``s`` starts,
- ``shuffle_idx`` ``[S]``    sample order.

They are cached as ``.npy`` files next to the data (or in ``cache_dir``), keyed by a hash of the document offsets
and every parameter, and re-opened memory-mapped, so the next run (and every other rank) starts instantly.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import torch

from ..utils.files import atomic_write_file
from .indexed import MMapTokenDataset

_INDEX_VERSION = 1


class PackedCausalLMDataset(torch.utils.data.Dataset):
    """Map-style dataset of ``num_samples`` windows of ``seq_len`` tokens.

    ``ds[i]`` is ``{"input_ids": LongTensor[seq_len]}``, plus ``"position_ids": LongTensor[seq_len]`` when
    ``document_position_ids`` (positions restart at 0 at the window start and after every document boundary, as
    Megatron's ``reset_position_ids`` and HF's packed-sequence attention expect).

    Args:
        source: a corpus prefix (``PREFIX.bin``/``PREFIX.idx``) or an :class:`MMapTokenDataset`.
        seq_len: tokens per sample.
        seed: seeds the per-epoch document shuffle and the sample shuffle (numpy Generators, no global state).
        num_samples: samples wanted; enough epochs are stitched together to provide them. Default: the samples of
            ``num_epochs`` epochs.
        num_epochs: epochs to cover when ``num_samples`` is not given (default 1).
        shuffle: shuffle documents per epoch and samples; ``False`` keeps the file order (``ds[i]`` is then
            ``tokens[i*seq_len:(i+1)*seq_len]``).
        cache: cache the index arrays on disk (``cache_dir`` or the corpus folder); unwritable folders fall back
            to an in-memory index with a warning.
        tokenizer: if given, checked against the tokenizer the corpus was written with (``ValueError``).
    """

    def __init__(self, source, seq_len: int, *, seed: int = 0, num_samples: int | None = None,
                 num_epochs: int | None = None, shuffle: bool = True, document_position_ids: bool = False,
                 cache: bool = True, cache_dir=None, tokenizer=None):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if num_samples is not None and num_epochs is not None:
            raise ValueError("pass num_samples or num_epochs, not both")
        self.data = source if isinstance(source, MMapTokenDataset) else MMapTokenDataset(source, tokenizer=tokenizer)
        if tokenizer is not None and isinstance(source, MMapTokenDataset):
            self.data.check_tokenizer(tokenizer)
        self.seq_len, self.seed, self.shuffle = int(seq_len), int(seed), bool(shuffle)
        self.document_position_ids = document_position_ids
        total = self.data.num_tokens
        if num_samples is not None:
            if num_samples <= 0:
                raise ValueError(f"num_samples must be positive, got {num_samples}")
            self.num_epochs = -(-num_samples * self.seq_len // total)
        else:
            self.num_epochs = 1 if num_epochs is None else int(num_epochs)
            if self.num_epochs <= 0:
                raise ValueError(f"num_epochs must be positive, got {num_epochs}")
            num_samples = self.num_epochs * total // self.seq_len
            if num_samples == 0:
                raise ValueError(f"corpus {self.data.prefix} has {total} tokens, fewer than seq_len={seq_len}")
        self.num_samples = int(num_samples)
        self._lengths = self.data.document_lengths()
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._load_or_build(cache, cache_dir)
        # plain views for the hot path (np.memmap indexing is several times slower per call)
        self._doc_idx, self._sample_idx, self._shuffle_idx = (
            a.view(np.ndarray) for a in (self.doc_idx, self.sample_idx, self.shuffle_idx))
        self._starts = self.data._offsets

    # ---- index -------------------------------------------------------------------------------------------------
    def _cache_key(self) -> str:
        spec = {"v": _INDEX_VERSION, "seq_len": self.seq_len, "seed": self.seed, "shuffle": self.shuffle,
                "num_samples": self.num_samples, "num_epochs": self.num_epochs,
                "offsets": hashlib.sha1(np.ascontiguousarray(self.data.doc_offsets).tobytes()).hexdigest()}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]

    def _load_or_build(self, cache: bool, cache_dir):
        if not cache:
            return self._build()
        folder = Path(cache_dir) if cache_dir is not None else Path(self.data.prefix).parent
        stem = f"{Path(self.data.prefix).name}.packed-{self._cache_key()}"
        paths = [folder / f"{stem}.{name}.npy" for name in ("doc_idx", "sample_idx", "shuffle_idx")]
        if all(p.is_file() for p in paths):
            try:
                return tuple(np.load(p, mmap_mode="r") for p in paths)
            except (ValueError, OSError):
                pass  # a foreign or damaged cache file: rebuild below and overwrite it
        arrays = self._build()
        try:
            for path, arr in zip(paths, arrays):
                atomic_write_file(path, lambda f, a=arr: np.save(f, a))
        except OSError as err:
            warnings.warn(f"cannot cache the sample index in {folder} ({err}); keeping it in memory", stacklevel=3)
        return arrays

    def _build(self):
        num_docs = len(self._lengths)
        id_dtype = np.int32 if num_docs < 2**31 else np.int64
        orders = []
        for epoch in range(self.num_epochs):
            order = np.arange(num_docs, dtype=id_dtype)
            if self.shuffle:
                np.random.default_rng([self.seed, 0, epoch]).shuffle(order)
            orders.append(order)
        doc_idx = np.concatenate(orders)
        ends = np.cumsum(self._lengths[doc_idx])  # stream position where each entry of doc_idx ends
        starts = np.arange(self.num_samples, dtype=np.int64) * self.seq_len
        assert starts[-1] + self.seq_len <= ends[-1], "not enough epochs for num_samples"
        # side="right" skips empty documents: a sample starts inside the first document that ends after it
        pos = np.searchsorted(ends, starts, side="right")
        before = np.where(pos > 0, ends[np.maximum(pos - 1, 0)], 0)
        sample_idx = np.stack([pos, starts - before], axis=1).astype(np.int64)
        shuffle_idx = np.arange(self.num_samples, dtype=np.int64)
        if self.shuffle:
            np.random.default_rng([self.seed, 1]).shuffle(shuffle_idx)
        return doc_idx, sample_idx, shuffle_idx

    # ---- access ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    @property
    def document_order(self) -> np.ndarray:
        """Document ids in stream order (``[E*D]``)."""
        return np.asarray(self.doc_idx)

    def stream_sample(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Window ``j`` of the stream (before the sample shuffle): ``(tokens int64[seq_len], doc_starts bool)``.

        ``doc_starts[t]`` is True where a new document begins at token ``t`` (not counting ``t == 0``).
        """
        pos, offset = self._sample_idx[j].tolist()
        doc = int(self._doc_idx[pos])
        take = int(self._lengths[doc]) - offset
        if take >= self.seq_len:  # fast path: the window lies inside one document
            return self.data.read(int(self._starts[doc]) + offset, self.seq_len), np.zeros(self.seq_len, bool)
        pieces, starts = [], np.zeros(self.seq_len, dtype=bool)
        filled = 0
        while filled < self.seq_len:
            doc = int(self._doc_idx[pos])
            take = min(self.seq_len - filled, int(self._lengths[doc]) - offset)
            if take > 0:
                if filled > 0:
                    starts[filled] = True
                pieces.append(self.data.read(int(self._starts[doc]) + offset, take))
                filled += take
            pos, offset = pos + 1, 0
        return (pieces[0] if len(pieces) == 1 else np.concatenate(pieces)), starts

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        tokens, starts = self.stream_sample(int(self._shuffle_idx[i % self.num_samples]))
        item = {"input_ids": torch.from_numpy(tokens)}
        if self.document_position_ids:
            item["position_ids"] = torch.from_numpy(_positions(starts))
        return item

    def __repr__(self) -> str:
        return (f"PackedCausalLMDataset({self.data.prefix!r}, seq_len={self.seq_len}, samples={self.num_samples}, "
                f"epochs={self.num_epochs}, seed={self.seed}, shuffle={self.shuffle})")


def _positions(starts: np.ndarray) -> np.ndarray:
    """Positions that restart at 0 where ``starts`` is True (and at index 0): int64 ``[seq_len]``."""
    idx = np.arange(starts.size, dtype=np.int64)
    seg_start = np.where(starts, idx, 0)
    np.maximum.accumulate(seg_start, out=seg_start)
    return idx - seg_start


def pack_stream_order(ds: PackedCausalLMDataset) -> np.ndarray:
    """The token stream the samples are cut from (stream order, all epochs): for tests and debugging."""
    docs = [ds.data[int(d)] for d in ds.document_order]
    return np.concatenate(docs).astype(np.int64)

