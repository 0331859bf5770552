"""Styles for parameters split along a dimension other than a linear layer's rows or columns.

- ``HeadwiseEmbedding``: an embedding table whose *columns* are attention heads, e.g. T5's
  ``relative_attention_bias`` (``[num_buckets, num_heads]``). Rank ``r`` keeps heads ``r*n/tp .. (r+1)*n/tp``,
  the same heads its column-parallel q/k/v produce, so the bias it looks up matches its attention scores.
  Forward: none. Backward: none (each rank's columns get their own gradients).
- ``VocabBias``: a vocabulary-sized ``bias`` held directly on a head module (BERT's ``cls.predictions.bias``,
  RoBERTa's ``lm_head.bias``), split and padded exactly like the vocab-parallel decoder it is tied to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Embedding
from .mappings import group_rank, group_size
from .plan import Style
from .sharding import EvenSplit, VocabSplit, axis_position
from .tensor_parallel import divide, padded_size


class HeadParallelEmbedding(Embedding):
    """``[num_embeddings, num_heads]`` table split along dim 1. Input ids ``[...]`` (replicated); output
    ``[..., num_heads/tp]``: this rank's heads. No collectives."""

    def __init__(self, num_embeddings: int, num_heads: int, *, group, device=None, dtype=None):
        self.group, self.tp_size, self.tp_rank = group, group_size(group), group_rank(group)
        self.full_num_heads = num_heads
        super().__init__(num_embeddings, divide(num_heads, self.tp_size, "number of heads"), device=device,
                         dtype=dtype)

    @classmethod
    def from_plain(cls, module: nn.Embedding, group) -> "HeadParallelEmbedding":
        return cls(module.num_embeddings, module.embedding_dim, group=group, device=module.weight.device,
                   dtype=module.weight.dtype)

    def forward(self, ids: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        return F.embedding(ids, self.weight)


@dataclass(frozen=True)
class HeadwiseEmbedding(Style):
    hf_style = "colwise"  # transformers' colwise on an nn.Embedding shards the last (here: heads) dim
    grid_layer = "head_embedding"  # 2D/2.5D: the grid's column blocks; 3D: the inner layout (over y)

    def build_1d(self, module, context):
        return HeadParallelEmbedding.from_plain(module, context.tp_group)

    def layouts(self, module):
        return {"weight": EvenSplit(1)}


@dataclass(frozen=True)
class VocabBias(Style):
    """The module's own ``bias`` (``[vocab]``) becomes this rank's padded slice ``[vocab_padded/tp]``.

    The module is kept (only the parameter changes); its full vocabulary size is recorded as ``vocab_size`` so
    the loader and saver can pad and strip. Padded entries are zero and never reach a checkpoint.
    """

    hf_style = None

    def build(self, module, context):
        bias = module.bias
        mode = context.tensor_parallel_mode
        # 2D/2.5D: split like the decoder's logits, over the grid's row (q ranks); 3D: like the decoder's rows, over
        # (y, z) (see Linear3D); 1D: over the whole group.
        module.vocab_axis = {"2d": "tp_row", "2.5d": "tp_row", "3d": ("tp_col", "tp_dep")}.get(mode, "tp")
        tp = axis_position(context, module.vocab_axis).size
        module.vocab_size = bias.shape[0]
        local = padded_size(module.vocab_size, tp) // tp
        module.bias = nn.Parameter(torch.zeros(local, device=bias.device, dtype=bias.dtype))
        module.grid_planned = context.is_grid  # its one parameter is laid out for the grid (see grid_boundary)
        return module

    def layouts(self, module):
        return {"bias": VocabSplit(0, module.vocab_size, axis=getattr(module, "vocab_axis", "tp"))}
