"""Packed documents: the one reading of ``position_ids`` / ``cu_seqlens`` / ``seq_idx`` into per-token document ids.

A packed row holds several documents one after the other; they must not see each other. The library reads that
from whichever of these the batch carries (native models, the generic path and the collators agree through this
module; it imports only torch):

- ``cu_seqlens [n + 1]`` (int): flash-attention's varlen offsets over the batch flattened row after row
  (``b * s`` tokens): document ``i`` is tokens ``cu_seqlens[i] .. cu_seqlens[i + 1]``. No document may cross a row
  end; tokens after ``cu_seqlens[-1]`` (padding) are one document each. ``transformers``' names
  ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (equal for self-attention) mean the same;
- ``seq_idx [b, s]`` (int): the document of every token (Mamba-2's name), equal ids contiguous within a row;
- ``position_ids [b, s]`` that restart: a new document starts wherever the position is not the previous one plus
  one, exactly ``transformers``' ``find_packed_sequence_indices``.

``attention_mask [b, s]`` (1 token, 0 padding) turns every padding token into a document of its own: it attends
to itself only and nothing attends to it, which for causal training (padding labelled -100) is the padded run.
"""
from __future__ import annotations

import torch

#: The batch keys that describe packed documents besides ``position_ids`` (consumed by the models).
PACKING_KEYS = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` document ids (0, 1, ... in each row) of ``position_ids [b, s]`` that restart per document."""
    position_ids = position_ids.to(torch.long)
    diff = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (diff != 1).cumsum(-1)


def from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """``[b, s]`` document ids of flash-attention offsets ``cu_seqlens [n + 1]`` over the flattened ``b * s`` tokens
    (``ValueError`` for offsets that are not increasing, exceed the batch or cross a row end)."""
    cu = torch.as_tensor(cu_seqlens).to(torch.long).flatten().cpu()
    total = batch * seq
    if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] <= cu[:-1]).any()) or int(cu[-1]) > total:
        raise ValueError(f"cu_seqlens must rise strictly from 0 to at most batch * seq = {total} tokens, got "
                         f"{cu.tolist()}")
    rows = cu[:-1] // seq
    if bool((rows != (cu[1:] - 1) // seq).any()):
        raise ValueError(f"cu_seqlens {cu.tolist()} has a document that crosses the end of a row of {seq} tokens: "
                         "pack each row separately (documents may not span rows)")
    starts = torch.zeros(total + 1, dtype=torch.long)
    starts[cu] = 1
    starts[torch.arange(cu[-1], total + 1)] = 1  # trailing padding: one document per token
    doc = starts[:total].cumsum(0).view(batch, seq)
    return doc - doc[:, :1]


def from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` document ids of ``seq_idx [b, s]`` (equal ids must be contiguous in a row: ``ValueError``)."""
    seq_idx = seq_idx.to(torch.long)
    changes = (torch.diff(seq_idx, dim=-1) != 0).sum(-1)
    distinct = torch.tensor([int(row.unique().numel()) for row in seq_idx])
    if bool((changes.cpu() + 1 != distinct).any()):
        raise ValueError("seq_idx gives a document non-contiguous tokens in a row: each document must be one run")
    return torch.nn.functional.pad((torch.diff(seq_idx, dim=-1) != 0).long(), (1, 0)).cumsum(-1)


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` positions restarting at 0 at every document of ``documents [b, s]`` (what a model that sees
    each document alone would number its tokens)."""
    return _run_positions(documents)


def _run_positions(ids: torch.Tensor) -> torch.Tensor:
    """Index of every token within its run of equal ``ids [b, s]``."""
    index = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    start = torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.where(start, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


def document_ids(batch: int, seq: int, *, position_ids=None, cu_seqlens=None, seq_idx=None, attention_mask=None,
                 device=None) -> torch.Tensor | None:
    """``[b, s]`` int64 document ids (rising along each row), or ``None`` when the real tokens of every row are one
    document (nothing packed: plain and padded batches, left padding included, stay with the model's own mask).
    Precedence: ``cu_seqlens``, then ``seq_idx``, then ``position_ids``. In a packed batch each padding token
    (``attention_mask [b, s]`` 0) is a document of its own, with an id above every real one."""
    if cu_seqlens is not None:
        documents = from_cu_seqlens(cu_seqlens, batch, seq)
    elif seq_idx is not None:
        documents = from_seq_idx(torch.as_tensor(seq_idx).expand(batch, seq))
    elif position_ids is not None:
        documents = from_position_ids(torch.as_tensor(position_ids).expand(batch, seq))
    else:
        return None
    device = device if device is not None else documents.device
    documents = documents.to(device)
    valid = torch.ones_like(documents, dtype=torch.bool)
    if attention_mask is not None and attention_mask.dim() == 2:
        valid = attention_mask.to(device=device, dtype=torch.bool)
    # packed when the real tokens of some row span documents (ids rise along a row); left padding, where positions
    # restart at the first real token, is not packing
    big = documents.max() + 1
    low = torch.where(valid, documents, big).amin(-1)
    high = torch.where(valid, documents, -1).amax(-1)
    if not bool((high > low).any()):
        return None
    lone = seq + torch.arange(seq, device=device).expand(batch, seq)  # a fresh id per padding token
    return torch.where(valid, documents, lone)


def cu_seqlens_of(documents: torch.Tensor) -> torch.Tensor:
    """``[n + 1]`` int32 flash-attention offsets of ``documents [b, s]`` over the flattened batch."""
    batch, seq = documents.shape
    start = torch.ones_like(documents, dtype=torch.bool)
    start[:, 1:] = documents[:, 1:] != documents[:, :-1]
    offsets = torch.nonzero(start.flatten()).flatten()
    return torch.cat([offsets, offsets.new_tensor([batch * seq])]).to(torch.int32)
