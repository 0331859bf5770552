"""Pack variable-length documents into rows of a token budget (first-fit), with the marks that keep them apart.

A packed row holds several documents one after the other. The models attend per document when the batch says
where documents start (``utils/documents.py``), so :func:`pack_documents` emits, besides ``input_ids`` and
``labels``:

- ``position_ids [r, budget]``: 0, 1, ... restarting at every document (0 on padding);
- ``cu_seqlens [n + 1]`` (int32): flash-attention offsets over the rows flattened (``r * budget`` tokens); each
  row's trailing padding is one segment of its own, so no segment crosses a row end;
- ``attention_mask [r, budget]``: 1 on tokens, 0 on the padding at a row's end.

``labels`` are -100 on each document's first token (under the causal shift it would be the target of the previous
document's last token), on padding, and wherever the document's own labels say (an SFT prompt). Loss and gradients
then equal those of the same documents one per row.

First-fit: documents are taken in the order given; each goes into the first row with room left, else a new row.
A document longer than the budget is cut into budget-sized pieces first (``split_long=True``: each piece a
document of its own, as a fixed-length pre-training window would cut it) or truncated to the budget
(``split_long=False``: an SFT example keeps its beginning). Everything is numpy on the host; tensors are ``int64``
(``cu_seqlens`` ``int32``).

``rows_multiple_of=m``: the batch gets empty rows (all padding: ids ``pad_token_id``, labels -100, positions 0,
``attention_mask`` 0, one ``cu_seqlens`` segment each) until its row count is a multiple of ``m``. A pipeline splits a
batch's rows into ``m`` microbatches; the number of packed rows depends on the documents' lengths. An empty row adds
nothing to the loss nor to any gradient (no label, and nothing attends to its tokens).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def first_fit(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Rows of document indices: each document in the first row with room left (order kept within a row)."""
    if budget <= 0:
        raise ValueError(f"the packing budget must be positive, got {budget}")
    rows: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        if length > budget:
            raise ValueError(f"a document of {length} tokens does not fit a row of {budget}")
        for row, left in enumerate(room):
            if length <= left:
                rows[row].append(index)
                room[row] -= length
                break
        else:
            rows.append([index])
            room.append(budget - length)
    return rows


def _pieces(ids: np.ndarray, labels: np.ndarray, budget: int, split_long: bool):
    if ids.size <= budget:
        return [(ids, labels)]
    if not split_long:
        return [(ids[:budget], labels[:budget])]
    return [(ids[i:i + budget], labels[i:i + budget]) for i in range(0, ids.size, budget)]


def pack_documents(documents: Sequence[np.ndarray], budget: int, *, pad_token_id: int = 0,
                   labels: Sequence[np.ndarray] | None = None, split_long: bool = True,
                   return_cu_seqlens: bool = True, rows_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Pack ``documents`` (1-D int arrays) into ``[r, budget]`` rows (module docstring). ``labels``: per-document
    targets (-100 where there is none, e.g. a prompt), default the document itself. ``rows_multiple_of``: empty rows
    appended until ``r`` divides by it (module docstring)."""
    if rows_multiple_of is not None and (not isinstance(rows_multiple_of, int) or rows_multiple_of <= 0):
        raise ValueError(f"rows_multiple_of must be a positive int, got {rows_multiple_of!r}")
    labels = [np.asarray(d) for d in documents] if labels is None else [np.asarray(lab) for lab in labels]
    pieces = [piece for doc, lab in zip(documents, labels)
              for piece in _pieces(np.asarray(doc), lab, budget, split_long) if piece[0].size]
    if not pieces:
        raise ValueError("nothing to pack: every document is empty")
    rows = first_fit([ids.size for ids, _ in pieces], budget)
    if rows_multiple_of:
        rows += [[] for _ in range(-len(rows) % rows_multiple_of)]
    shape = (len(rows), budget)
    input_ids = np.full(shape, pad_token_id, dtype=np.int64)
    target = np.full(shape, -100, dtype=np.int64)
    positions = np.zeros(shape, dtype=np.int64)
    real = np.zeros(shape, dtype=np.int64)
    offsets = [0]
    for r, members in enumerate(rows):
        start = 0
        for index in members:
            ids, lab = pieces[index]
            end = start + ids.size
            input_ids[r, start:end], target[r, start:end] = ids, lab
            target[r, start] = -100  # no target across the document boundary
            positions[r, start:end], real[r, start:end] = np.arange(ids.size), 1
            offsets.append(r * budget + end)
            start = end
        if start < budget:  # the row's padding: one segment of its own
            offsets.append((r + 1) * budget)
    batch = {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(target),
             "position_ids": torch.from_numpy(positions), "attention_mask": torch.from_numpy(real)}
    if return_cu_seqlens:
        batch["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32)
    return batch
