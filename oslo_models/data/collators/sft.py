"""Supervised fine-tuning batches: prompt + completion, the loss on the completion only, padded or packed."""
from __future__ import annotations

import numpy as np
import torch

from ._utils import as_tokens, packing_pad_id, pad, pad_id_of, padded_length
from .packing import pack_documents


def _example(example) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, labels)`` of one example: ``prompt_ids`` + ``completion_ids``, or ``input_ids`` with a
    ``completion_mask`` (TRL's names; 1 on completion tokens); labels -100 on the prompt."""
    if not isinstance(example, dict):
        raise ValueError("SFT examples are dicts with prompt_ids and completion_ids (or input_ids and "
                         "completion_mask)")
    if "prompt_ids" in example or "completion_ids" in example:
        prompt = as_tokens(example.get("prompt_ids", []))
        completion = as_tokens(example["completion_ids"])
        ids = np.concatenate([prompt, completion])
        keep = np.concatenate([np.zeros(prompt.size, dtype=bool), np.ones(completion.size, dtype=bool)])
    elif "input_ids" in example and "completion_mask" in example:
        ids = as_tokens(example["input_ids"])
        keep = np.asarray(example["completion_mask"]).astype(bool)
        if keep.shape != ids.shape:
            raise ValueError(f"completion_mask {keep.shape} does not match input_ids {ids.shape}")
    else:
        raise ValueError(f"an SFT example needs prompt_ids + completion_ids or input_ids + completion_mask, got "
                         f"keys {sorted(example)}")
    return ids, np.where(keep, ids, -100)


class SFTCollator:
    """Batch prompt/completion examples for supervised fine-tuning; the loss falls on completion tokens only.

    Examples: dicts with ``prompt_ids`` and ``completion_ids``, or ``input_ids`` with ``completion_mask`` (1 on the
    completion). Output, ``int64`` ``[batch, seq]``: ``input_ids`` (prompt then completion, right-padded with
    ``pad_token_id``), ``attention_mask``, ``labels`` (the completion's tokens, -100 on the prompt and padding; the
    model shifts them). ``max_length`` truncates each example (its beginning is kept, as TRL's ``max_length``).

    ``pack_to=N``: examples packed first-fit into rows of ``N`` tokens (``packing.py``: ``position_ids`` restarting
    per example, ``cu_seqlens`` unless ``return_cu_seqlens=False``, ``attention_mask``; an example longer than ``N``
    is truncated to ``N``); the models attend per example, so loss and gradients are the padded batch's.
    ``rows_multiple_of=m`` (with ``pack_to``): empty rows are appended until the row count divides by ``m`` (a
    pipeline's microbatches; they add nothing to loss or gradients).
    """

    def __init__(self, tokenizer=None, *, pad_token_id: int | None = None, max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, pack_to: int | None = None, return_cu_seqlens: bool = True,
                 rows_multiple_of: int | None = None):
        self.tokenizer, self.pad_token_id = tokenizer, pad_token_id
        self.max_length, self.pad_to_multiple_of = max_length, pad_to_multiple_of
        self.pack_to, self.return_cu_seqlens, self.rows_multiple_of = pack_to, return_cu_seqlens, rows_multiple_of

    def __call__(self, examples) -> dict[str, torch.Tensor]:
        if len(examples) == 0:
            raise ValueError("cannot collate an empty list of examples")
        pairs = [_example(e) for e in examples]
        if self.max_length is not None:
            pairs = [(ids[:self.max_length], lab[:self.max_length]) for ids, lab in pairs]
        if self.pack_to is not None:
            return pack_documents([ids for ids, _ in pairs], self.pack_to, labels=[lab for _, lab in pairs],
                                  pad_token_id=packing_pad_id(self.tokenizer, self.pad_token_id), split_long=False,
                                  return_cu_seqlens=self.return_cu_seqlens, rows_multiple_of=self.rows_multiple_of)
        lengths = [ids.size for ids, _ in pairs]
        length = padded_length(lengths, self.pad_to_multiple_of)
        needs_pad = any(n != length for n in lengths)
        pad_id = pad_id_of(self.tokenizer, self.pad_token_id, "SFTCollator") if needs_pad else 0
        input_ids = pad([ids for ids, _ in pairs], pad_id, length)
        labels = pad([lab for _, lab in pairs], -100, length)
        real = torch.from_numpy(np.arange(length)[None, :] < np.asarray(lengths)[:, None])
        return {"input_ids": input_ids, "attention_mask": real.long(), "labels": labels}
