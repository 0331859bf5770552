"""Causal-LM and seq2seq padding collators."""
from __future__ import annotations

import numpy as np
import torch

from ._utils import as_tokens, field, packing_pad_id, pad, pad_id_of, padded_length
from .packing import pack_documents


class CausalLMCollator:
    """Batch causal-LM samples: ``input_ids``, ``attention_mask``, ``labels`` (and ``position_ids``).

    Examples are dicts with ``input_ids`` (list / numpy / tensor) and optionally ``position_ids`` (e.g. from
    ``PackedCausalLMDataset(document_position_ids=True)``), or bare id sequences. Output, all ``int64``
    ``[batch, seq]``: ``input_ids`` right-padded with ``pad_token_id``; ``attention_mask`` 1 on real tokens;
    ``labels`` a copy of ``input_ids`` with -100 on padding (HF models shift labels inside the loss);
    ``position_ids`` when the examples carry them or ``return_position_ids`` (0..n-1, padded with 0).

    ``pad_token_id`` is only needed when lengths differ (packed samples never pad).

    ``pack_to=N``: the examples are documents, packed first-fit into rows of ``N`` tokens (``packing.py``; a longer
    document is cut into pieces of ``N``): ``input_ids``, ``labels`` (-100 on each document's first token and on
    padding), ``position_ids`` restarting per document, ``attention_mask`` and ``cu_seqlens`` (unless
    ``return_cu_seqlens=False``); the models attend per document. The number of rows depends on the lengths. The
    padding id is ``pad_token_id`` or the tokenizer's, else 0 (a padding token is never attended to nor a target).
    ``rows_multiple_of=m`` (with ``pack_to``): empty rows are appended until the row count divides by ``m`` (a
    pipeline's microbatches; they add nothing to loss or gradients).
    """

    def __init__(self, tokenizer=None, *, pad_token_id: int | None = None, return_position_ids: bool = False,
                 pad_to_multiple_of: int | None = None, max_length: int | None = None, pack_to: int | None = None,
                 return_cu_seqlens: bool = True, rows_multiple_of: int | None = None):
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.return_position_ids = return_position_ids
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_length = max_length
        self.pack_to, self.return_cu_seqlens, self.rows_multiple_of = pack_to, return_cu_seqlens, rows_multiple_of

    def __call__(self, examples) -> dict[str, torch.Tensor]:
        if len(examples) == 0:
            raise ValueError("cannot collate an empty list of examples")
        ids = [as_tokens(field(e)) for e in examples]
        if self.pack_to is not None:
            return pack_documents(ids, self.pack_to, pad_token_id=packing_pad_id(self.tokenizer, self.pad_token_id),
                                  return_cu_seqlens=self.return_cu_seqlens, rows_multiple_of=self.rows_multiple_of)
        lengths = [s.size for s in ids]
        length = padded_length(lengths, self.pad_to_multiple_of, self.max_length)
        needs_pad = any(n != length for n in lengths)
        pad_id = pad_id_of(self.tokenizer, self.pad_token_id, "CausalLMCollator") if needs_pad else 0
        input_ids = pad(ids, pad_id, length)
        real = torch.from_numpy(np.arange(length)[None, :] < np.asarray(lengths)[:, None])
        batch = {"input_ids": input_ids, "attention_mask": real.long(),
                 "labels": input_ids.masked_fill(~real, -100)}
        has_pos = [isinstance(e, dict) and "position_ids" in e for e in examples]
        if any(has_pos):
            if not all(has_pos):
                raise ValueError("some examples have position_ids and some do not")
            batch["position_ids"] = pad([as_tokens(e["position_ids"]) for e in examples], 0, length)
        elif self.return_position_ids:
            batch["position_ids"] = torch.arange(length).expand(len(ids), length).masked_fill(~real, 0)
        return batch


class Seq2SeqCollator:
    """Pad encoder-decoder examples ``{"input_ids", "labels"}`` (lists / arrays / tensors of ids).

    Output, all ``int64``: ``input_ids`` ``[batch, src]`` right-padded with ``pad_token_id``, ``attention_mask``
    ``[batch, src]``, ``labels`` ``[batch, tgt]`` padded with ``label_pad_token_id`` (-100: ignored by the loss),
    and ``decoder_input_ids`` ``[batch, tgt]``: labels shifted right by one, starting with
    ``decoder_start_token_id`` (default: the pad id, as T5 does), with -100 replaced by the pad id.
    """

    def __init__(self, tokenizer=None, *, pad_token_id: int | None = None, label_pad_token_id: int = -100,
                 decoder_start_token_id: int | None = None, return_decoder_input_ids: bool = True,
                 pad_to_multiple_of: int | None = None):
        self.pad_id = pad_id_of(tokenizer, pad_token_id, "Seq2SeqCollator")
        self.label_pad_token_id = label_pad_token_id
        self.decoder_start_token_id = self.pad_id if decoder_start_token_id is None else int(decoder_start_token_id)
        self.return_decoder_input_ids = return_decoder_input_ids
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples) -> dict[str, torch.Tensor]:
        if len(examples) == 0:
            raise ValueError("cannot collate an empty list of examples")
        src = [as_tokens(field(e, "input_ids")) for e in examples]
        tgt = [as_tokens(field(e, "labels")) for e in examples]
        return collate_seq2seq(src, tgt, pad_id=self.pad_id, label_pad_id=self.label_pad_token_id,
                               decoder_start_id=self.decoder_start_token_id if self.return_decoder_input_ids
                               else None, pad_to_multiple_of=self.pad_to_multiple_of)


def collate_seq2seq(src, tgt, *, pad_id: int, label_pad_id: int = -100, decoder_start_id: int | None,
                    pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Pad source/target id arrays into the HF encoder-decoder batch (see :class:`Seq2SeqCollator`)."""
    src_len = padded_length([s.size for s in src], pad_to_multiple_of)
    tgt_len = padded_length([t.size for t in tgt], pad_to_multiple_of)
    input_ids = pad(src, pad_id, src_len)
    mask = torch.from_numpy(np.arange(src_len)[None, :] < np.array([s.size for s in src])[:, None]).long()
    labels = pad(tgt, label_pad_id, tgt_len)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    if decoder_start_id is not None:
        batch["decoder_input_ids"] = shift_right(labels, decoder_start_id, pad_id)
    return batch


def shift_right(labels: torch.Tensor, decoder_start_token_id: int, pad_token_id: int) -> torch.Tensor:
    """``[start, l0, l1, ...]`` from ``labels`` ``[batch, tgt]`` with -100 turned into ``pad_token_id``."""
    shifted = labels.new_full(labels.shape, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_token_id)
