"""Give each sequence-parallel rank its contiguous slice of the sequence dimension."""
from __future__ import annotations

import torch

_DEFAULT_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "token_type_ids")


class SequenceParallelSplitter:
    """Keep tp rank ``r``'s slice ``[r*S/T, (r+1)*S/T)`` of dim 1 (HF ``[batch, seq, ...]`` layout) of a batch.

    Args:
        parallel_context: any object with ``tp_rank`` and ``tp_size``; explicit ``tp_rank``/``tp_size`` win.
        keys: batch entries to split (default ``input_ids``, ``labels``, ``shift_labels``, ``position_ids``,
            ``token_type_ids`` when present). Other entries pass through whole: ``attention_mask`` in particular,
            because attention on a sequence-parallel rank still looks at the keys of the full sequence.
        add_position_ids: add ``position_ids`` = ``0..S-1`` before splitting when the batch has none, so each
            rank's slice keeps its global positions.
        shift_labels: replace ``labels`` by ``shift_labels`` (``labels[:, 1:]`` padded with -100), i.e. the label
            of every position is its next token. HF models shift ``labels`` inside the loss, which on a slice
            would drop the prediction at each slice edge; HF losses accept ``shift_labels`` unshifted instead.

    Raises ``ValueError`` when the sequence length is not divisible by ``tp_size``, or entries disagree on it.
    """

    def __init__(self, parallel_context=None, *, tp_rank: int | None = None, tp_size: int | None = None,
                 keys=_DEFAULT_KEYS, add_position_ids: bool = True, shift_labels: bool = False):
        if tp_rank is None:
            tp_rank = getattr(parallel_context, "tp_rank", 0) if parallel_context is not None else 0
        if tp_size is None:
            tp_size = getattr(parallel_context, "tp_size", 1) if parallel_context is not None else 1
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
        self.keys, self.add_position_ids, self.shift_labels = tuple(keys), add_position_ids, shift_labels

    def __call__(self, batch: dict) -> dict:
        present = [k for k in self.keys if isinstance(batch.get(k), torch.Tensor)]
        if not present:
            raise ValueError(f"batch has none of the keys to split {self.keys}")
        seq_lens = {k: batch[k].shape[1] for k in present if batch[k].dim() >= 2}
        if len(set(seq_lens.values())) != 1:
            raise ValueError(f"entries disagree on the sequence length (dim 1): {seq_lens}")
        seq_len = next(iter(seq_lens.values()))
        if seq_len % self.tp_size:
            raise ValueError(f"sequence length {seq_len} is not divisible by the sequence-parallel size "
                             f"{self.tp_size}; pad to a multiple (e.g. pad_to_multiple_of={self.tp_size})")
        out = dict(batch)
        ref = batch[present[0]]
        if self.add_position_ids and "position_ids" not in out and "position_ids" in self.keys:
            out["position_ids"] = torch.arange(seq_len, device=ref.device).expand(ref.shape[0], seq_len)
        if self.shift_labels and "labels" in out:
            labels = out.pop("labels")
            shifted = torch.full_like(labels, -100)
            shifted[:, :-1] = labels[:, 1:]
            out["shift_labels"] = shifted
        chunk = seq_len // self.tp_size
        for key in self.keys:
            if isinstance(out.get(key), torch.Tensor) and out[key].dim() >= 2:
                out[key] = out[key].narrow(1, self.tp_rank * chunk, chunk).contiguous()
        return out
