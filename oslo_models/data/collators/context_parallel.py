"""Give each context-parallel rank its chunk(s) of every sequence of a batch."""
from __future__ import annotations

import torch

from ...parallel_layers.context_parallel.chunking import check_sequence_length, split_sequence
from ...utils.documents import PACKING_KEYS

_DEFAULT_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "token_type_ids", "attention_mask",
                 "special_tokens_mask", "decoder_input_ids", "decoder_attention_mask")
#: an encoder-decoder batch's target side (its own length), split apart from the source
TARGET_KEYS = ("labels", "decoder_input_ids", "decoder_attention_mask")


class ContextParallelSplitter:
    """Keep cp rank ``r``'s chunk(s) of dim 1 (HF ``[batch, seq, ...]``) of a collated batch.

    The layout follows ``ParallelConfig.context_parallel_mode`` (``parallel_layers/context_parallel/chunking.py``):
    ``"ring"`` gives rank ``r`` chunks ``r`` and ``2cp-1-r`` of ``2cp`` (causal load balancing), ``"all_to_all"``
    chunk ``r`` of ``cp``. The model computes the global ``position_ids`` of its tokens itself; ``position_ids``
    that are in the batch (packed documents) are split like the rest.

    Args:
        parallel_context: the model's ``ParallelContext`` (``cp_rank``, ``cp_size``, ``config.context_parallel_mode``);
            explicit ``cp_rank`` / ``cp_size`` / ``mode`` win.
        shift_labels: causal LMs: add ``shift_labels`` = ``labels`` shifted left on the *full* sequence (last
            position ``-100``) before splitting, so the target of each chunk's last token (the next chunk's first)
            is kept; the model's loss reads ``shift_labels`` (``labels`` stay in the batch, split, as
            ``transformers`` wants both). ``False`` for MLM (no shift).
        keys: batch entries to split; others pass through whole.

    An encoder-decoder batch (one with ``decoder_input_ids``: shifted on the full target before the split, as
    ``Seq2SeqCollator`` makes them) has two lengths: the source entries and the target entries (``TARGET_KEYS``)
    are each split into the layout's chunks; its labels are not shifted (no ``shift_labels``).

    Raises ``ValueError`` when a sequence length does not split into the layout's chunks, or entries of one side
    disagree on it.
    """

    def __init__(self, parallel_context=None, *, cp_rank: int | None = None, cp_size: int | None = None,
                 mode: str | None = None, shift_labels: bool = True, keys=_DEFAULT_KEYS):
        if cp_rank is None:
            cp_rank = getattr(parallel_context, "cp_rank", 0)
        if cp_size is None:
            cp_size = getattr(parallel_context, "cp_size", 1)
        if mode is None:
            config = getattr(parallel_context, "config", None)
            mode = getattr(config, "context_parallel_mode", "ring")
        self.cp_rank, self.cp_size, self.mode = int(cp_rank), int(cp_size), mode
        if self.cp_size <= 0 or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
        check_sequence_length(0, self.cp_size, mode)  # an unknown mode fails here, not at the first batch
        self.keys, self.shift_labels = tuple(keys), shift_labels

    def __call__(self, batch: dict) -> dict:
        present = [k for k in self.keys if isinstance(batch.get(k), torch.Tensor) and batch[k].dim() >= 2]
        if not present:
            raise ValueError(f"batch has none of the keys to split {self.keys}")
        seq2seq = isinstance(batch.get("decoder_input_ids"), torch.Tensor)
        sides = ([[k for k in present if k not in TARGET_KEYS], [k for k in present if k in TARGET_KEYS]] if seq2seq
                 else [present])
        for side in filter(None, sides):
            seq_lens = {k: batch[k].shape[1] for k in side}
            if len(set(seq_lens.values())) != 1:
                raise ValueError(f"entries disagree on the sequence length (dim 1): {seq_lens}")
            check_sequence_length(next(iter(seq_lens.values())), self.cp_size, self.mode)
        out = dict(batch)
        if isinstance(out.get("position_ids"), torch.Tensor):  # offsets over the whole rows are wrong per chunk:
            for key in PACKING_KEYS:  # the split position_ids carry the documents
                out.pop(key, None)
        if self.shift_labels and not seq2seq and "labels" in out and "shift_labels" not in out:
            out["shift_labels"] = torch.nn.functional.pad(out["labels"], (0, 1), value=-100)[:, 1:]
        for key in self.keys:
            if isinstance(out.get(key), torch.Tensor) and out[key].dim() >= 2:
                out[key] = split_sequence(out[key], self.cp_rank, self.cp_size, self.mode).contiguous()
        return out
