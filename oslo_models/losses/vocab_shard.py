"""Which part of the vocabulary a rank's logits hold, and the row-chunked reductions every primitive shares.

A vocab-parallel LM head (``ColumnParallelLinear`` with ``vocab_size``) gives rank ``r`` of the tensor-parallel
group the logits ``[..., V_padded/tp]`` of vocabulary ids ``r * V_padded/tp ..``; columns of ids ``>= V`` (padding
to a multiple of ``tp``) hold ``-inf``. :class:`VocabShard` names that split (``group``, ``vocab_start``, the real
``vocab_size``); :meth:`VocabShard.of` reads it from a model or its output layer. ``VocabShard()`` (no group) is the
whole vocabulary in one process, so the same primitives run single-process.

Sequence parallelism: the head gathers the sequence before its matmul (``ColumnParallelLinear`` enters the
tensor-parallel region), so the logits hold every position on every rank of the group, with or without it, and the
primitives see the same ``[..., V_padded/tp]`` either way.

Memory: the primitives walk the rows (tokens) in chunks of ``chunk_rows`` and cast one chunk at a time to fp32, so
no ``[tokens, vocab]`` fp32 tensor is ever whole; what they keep between forward and backward is the logits they
were given and a few ``[tokens]`` vectors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel_layers.mappings import group_size

#: elements of one fp32 chunk (``rows x local vocabulary``) a primitive materializes at a time: 16 MiB
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: ids ``vocab_start .. vocab_start + V_local`` of ``vocab_size``, split
    over ``group`` (``None``: one process holds the whole vocabulary)."""

    group: object = None
    vocab_start: int = 0
    vocab_size: int | None = None

    @classmethod
    def of(cls, model_or_head) -> "VocabShard":
        """The split of ``model_or_head``'s output layer (a model with ``get_output_embeddings``, or the layer
        itself): its tensor-parallel group, first vocabulary id and real vocabulary size. A plain layer (or tp 1)
        gives the whole vocabulary. The 2D / 2.5D / 3D grid heads split the tokens as well as the vocabulary:
        ``NotImplementedError`` (their loss runs through ``parallel_layers.cross_entropy``)."""
        head = model_or_head
        if hasattr(head, "get_output_embeddings"):
            head = head.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model_or_head).__name__} has no output embeddings (LM head)")
        group = getattr(head, "group", None)
        if group is not None and not isinstance(group, dist.ProcessGroup) and hasattr(group, "vocab_group"):
            raise NotImplementedError(
                "The post-training losses split the vocabulary over a 1D tensor-parallel group; the 2D / 2.5D / 3D "
                "grid heads also split the tokens over the grid. Use tensor_parallel_mode='1d'")
        vocab_size = getattr(head, "vocab_size", None)
        if vocab_size is None:
            vocab_size = getattr(head, "out_features", None)
        return cls(group=group, vocab_start=int(getattr(head, "vocab_start_index", 0)), vocab_size=vocab_size)

    @property
    def size(self) -> int:
        """Ranks the vocabulary is split over."""
        return group_size(self.group)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place over the group (a no-op in one process); returns ``tensor``."""
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[size, *tensor.shape]``: every rank's ``tensor``, in group-rank order."""
        if self.size == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)

    def local_ids(self, ids: torch.Tensor, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(owned, local)``: whether this rank's columns hold vocabulary id ``ids`` (negative ids, e.g. ``-100``,
        are owned by none) and its column there (clamped into range where not owned)."""
        local = ids - self.vocab_start
        owned = (ids >= 0) & (local >= 0) & (local < num_local)
        return owned, local.clamp(0, num_local - 1)


def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V_local]`` -> ``[tokens, V_local]`` (a view when possible)."""
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension, got a scalar")
    return logits.reshape(-1, logits.shape[-1])


def chunk_rows(num_rows: int, num_local: int, chunk_size: int | None) -> int:
    """Rows per chunk: ``chunk_size`` when given, else as many as fit ``CHUNK_ELEMENTS`` fp32 elements."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
        return chunk_size
    return max(1, min(num_rows, CHUNK_ELEMENTS // max(1, num_local)))


def row_slices(num_rows: int, rows_per_chunk: int):
    """``slice`` objects covering ``0 .. num_rows`` in chunks."""
    return [slice(start, min(start + rows_per_chunk, num_rows)) for start in range(0, num_rows, rows_per_chunk)]


def check_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return float(temperature)


def finite_or_zero(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights * values`` with ``0`` where ``weights == 0`` (a padded column's ``0 * -inf`` is not a NaN)."""
    return torch.where(weights > 0, weights * values, torch.zeros((), dtype=values.dtype, device=values.device))
