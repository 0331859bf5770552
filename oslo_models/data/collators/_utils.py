"""Helpers shared by the collators: token extraction, padding, per-example random generators."""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch


def as_tokens(x) -> np.ndarray:
    """A 1-D int64 numpy array from a list / numpy array / torch tensor of token ids."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def field(example, key: str = "input_ids"):
    """``example[key]`` for dict examples; a bare sequence is taken as the ``input_ids`` itself."""
    if isinstance(example, dict):
        if key not in example:
            raise ValueError(f"example has no {key!r} (keys: {sorted(example)})")
        return example[key]
    if key != "input_ids":
        raise ValueError(f"bare sequences have no {key!r}; pass dicts")
    return example


def padded_length(lengths: Sequence[int], pad_to_multiple_of: int | None, max_length: int | None = None) -> int:
    length = max(lengths) if len(lengths) else 0
    if max_length is not None:
        if length > max_length:
            raise ValueError(f"a sequence of {length} tokens is longer than max_length={max_length}")
        length = max_length
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    return length


def pad(seqs: Sequence[np.ndarray], value: int, length: int) -> torch.Tensor:
    """Right-pad 1-D int arrays to ``[len(seqs), length]`` int64 with ``value``."""
    out = np.full((len(seqs), length), value, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : s.size] = s
    return torch.from_numpy(out)


def example_rng(seed: int, tokens: np.ndarray, salt: int = 0) -> np.random.Generator:
    """A Generator that depends only on ``(seed, salt, tokens)``.

    Keying the noise of a collator on the example itself makes it independent of batch size, worker process, dp
    rank and restarts: a resumed run masks every sample exactly as the uninterrupted run did, and tp ranks that
    collate the same batch agree without communicating.
    """
    digest = hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()
    words = np.frombuffer(digest, dtype=np.uint32).tolist()
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(seed) >> 32, int(salt), *words])


def pad_id_of(tokenizer, pad_token_id: int | None, what: str) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    raise ValueError(f"{what} needs a pad_token_id (the tokenizer has none): pass pad_token_id=")


def packing_pad_id(tokenizer, pad_token_id: int | None) -> int:
    """The id of a packed row's padding: the given or the tokenizer's pad id, else 0 (nothing attends to a packed
    row's padding and it is no target, so any id serves)."""
    if pad_token_id is not None:
        return int(pad_token_id)
    if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
        return int(tokenizer.pad_token_id)
    return 0
