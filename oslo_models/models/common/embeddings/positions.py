"""Position components other than rotary: OPT's learned absolute positions and Bloom's ALiBi biases.

``LearnedPositionalEmbedding`` is ``transformers``' ``OPTLearnedPositionalEmbedding``: a table of
``num_positions + offset`` rows (OPT: offset 2, a fairseq legacy), looked up at the positions counted from the
attention mask (``cumsum(mask) * mask - 1``, so left padding does not shift them; padded tokens read row
``offset - 1``). Under tensor parallelism the table is replicated (``PositionEmbedding``: looked up whole on every
rank and added to the residual stream); no collective. Under the grid modes (2D / 2.5D / 3D) it is split over the
hidden like the stream it joins: ``LearnedPositionalEmbedding2D``, the grid's ``HiddenEmbedding2D`` (which the cube
uses for its stream too) with the same row arithmetic, so the offset survives the swap the plan makes.

ALiBi (Press et al.; ``transformers``' ``build_alibi_tensor`` in Bloom): head ``i`` of ``n`` adds ``slope_i * j`` to
the score of key ``j`` (``j`` counted over the unmasked keys); softmax is shift-invariant, so this equals the
relative bias ``slope_i * (j - i_query)``. Under tensor parallelism rank ``r`` runs heads ``r*n/tp ..
(r+1)*n/tp - 1`` (the ``q_proj`` split), so it takes that slice of the slopes (``local_alibi_slopes``): plain
functions, no parameters, no collective.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ....parallel_layers.layers import Embedding
from ....parallel_layers.plan import PositionEmbedding
from ....parallel_layers.tensor_parallel_2d import HiddenEmbedding2D
from ....utils.documents import positions_in_documents


def _position_rows(attention_mask, past_key_values_length: int, position_ids, offset: int) -> torch.Tensor:
    """The table rows of ``LearnedPositionalEmbedding.forward``'s arguments: ``position_ids + offset``, the positions
    counted from the mask when not given."""
    if position_ids is None:
        position_ids = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()
        position_ids = position_ids[:, past_key_values_length:]
    return position_ids + offset


@dataclass(frozen=True)
class LearnedPositions(PositionEmbedding):
    """``PositionEmbedding`` whose grid layer keeps the offset lookup (``LearnedPositionalEmbedding2D``): the plain
    grid table takes table rows, and the model calls it with the mask and positions."""

    def build(self, module, context):
        if not context.is_grid:
            return super().build(module, context)
        return LearnedPositionalEmbedding2D.from_learned(module, context)


class LearnedPositionalEmbedding(Embedding):
    """``forward(attention_mask [b, s_total], past_key_values_length=0, position_ids=None)`` -> ``[b, s, h]``:
    rows ``position + offset``; ``position_ids`` (``[b, s]``), when given, are used as they are."""

    tp_plan = {"": LearnedPositions()}

    def __init__(self, num_positions: int, embedding_dim: int, *, offset: int = 2, device=None, dtype=None):
        self.offset = offset
        super().__init__(num_positions + offset, embedding_dim, device=device, dtype=dtype)

    def forward(self, attention_mask: torch.Tensor, past_key_values_length: int = 0,
                position_ids: torch.Tensor | None = None, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        return super().forward(_position_rows(attention_mask, past_key_values_length, position_ids, self.offset))


class LearnedPositionalEmbedding2D(HiddenEmbedding2D):
    """``LearnedPositionalEmbedding`` under 2D / 2.5D / 3D: the ``[num_positions + offset, h/q]`` block of the
    stream's hidden axis (``HiddenEmbedding2D``: no collective forward, gradient summed over the column and depth
    groups), same arguments; input ``[1 or b/(dq), s]`` positions, output ``[., s, h/q]``."""

    @classmethod
    def from_learned(cls, module: LearnedPositionalEmbedding, context) -> "LearnedPositionalEmbedding2D":
        layer = cls.from_plain(module, context)
        layer.offset = module.offset
        return layer

    def forward(self, attention_mask: torch.Tensor, past_key_values_length: int = 0,
                position_ids: torch.Tensor | None = None, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        return super().forward(_position_rows(attention_mask, past_key_values_length, position_ids, self.offset))


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """The ``[n]`` ALiBi slopes (fp32): the geometric series ``2 ** (-8 i / n)`` for a power-of-two ``n``; otherwise
    that of the closest lower power of two followed by every other slope of twice as many heads (Bloom's rule)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = torch.pow(torch.tensor(base, device=device, dtype=torch.float32),
                       torch.arange(1, 1 + closest, device=device, dtype=torch.int32))
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, num_heads - closest)
        extra = torch.pow(torch.tensor(extra_base, device=device, dtype=torch.float32),
                          torch.arange(1, 1 + 2 * remaining, 2, device=device, dtype=torch.int32))
        slopes = torch.cat([slopes, extra], dim=0)
    return slopes


def local_alibi_slopes(num_heads: int, tp_rank: int, tp_size: int, device=None) -> torch.Tensor:
    """This tensor-parallel rank's ``[n/tp]`` slopes: those of the query heads it holds (contiguous, as
    ``Colwise`` splits ``q_proj``/``query_key_value``)."""
    if num_heads % tp_size:
        raise ValueError(f"num_heads={num_heads} is not divisible by tensor_parallel_size={tp_size}")
    per_rank = num_heads // tp_size
    return alibi_slopes(num_heads, device)[tp_rank * per_rank:(tp_rank + 1) * per_rank]


def build_alibi(attention_mask: torch.Tensor, slopes: torch.Tensor, dtype: torch.dtype,
                key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """The additive bias ``[b, n_local, 1, s]`` for ``attention_mask [b, s]`` (1 = token, 0 = padding) and the
    heads of ``slopes [n_local]``; broadcast over the query dim. ``transformers``' ``build_alibi_tensor`` is the same
    values as ``[b * n, 1, s]``. ``key_positions [b, s]`` replace the positions counted from the mask (packed rows:
    positions within each document)."""
    if key_positions is None:
        key_positions = (attention_mask.cumsum(dim=-1) - 1) * attention_mask
    positions = key_positions[:, None, None, :]  # [b, 1, 1, s]
    return (slopes.to(attention_mask.device)[None, :, None, None] * positions).to(dtype)


def alibi_attention_mask(attention_mask, shape_like: torch.Tensor, past_key_values, slopes: torch.Tensor, *,
                         divisor: float = 1.0, documents: torch.Tensor | None = None) -> torch.Tensor:
    """The additive attention mask of a causal ALiBi decoder, the bias inside it: ``[b, n_local, s, k]`` (``k = past
    + s``), ``build_alibi(...) / divisor`` where a key is visible (causal and not padding) and the dtype's minimum
    elsewhere, in ``shape_like``'s dtype. Bloom adds the bias unscaled, Falcon divides it by ``sqrt(head_dim)``.

    ``attention_mask``: ``[b, k]`` (1 = token, 0 = padding; covering the cached tokens too) or ``None`` (no
    padding); ``shape_like``: ``[b, s, ...]`` (batch, length, dtype and device are read); ``slopes``: this rank's
    ``[n_local]``. A row with no visible key (a left-padded query) is all minimum, so its softmax is uniform, as in
    ``transformers``' ALiBi decoders. Every attention kernel takes the result as its mask (SDPA: no ``is_causal``).
    ``documents [b, s]`` (packed rows, no cache): a key is visible only from its own document, and its bias counts
    its position within that document (what the document alone would get; Falcon's bfloat16 slopes round the
    product differently at other positions, so a per-row constant shift would not be exact).
    No collective: each tensor-parallel rank builds the mask of its own heads."""
    batch, length = shape_like.shape[:2]
    device, dtype = shape_like.device, shape_like.dtype
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    total = past + length
    if attention_mask is None:
        attention_mask = torch.ones(batch, total, dtype=torch.long, device=device)
    elif isinstance(attention_mask, dict) or attention_mask.ndim != 2 or attention_mask.shape[-1] != total:
        found = "a dict of masks" if isinstance(attention_mask, dict) else f"shape {tuple(attention_mask.shape)}"
        raise ValueError(f"ALiBi builds its bias from the 2D padding mask [batch, past + length] = [{batch}, {total}]"
                         f", got {found} (a static cache's prepared 4D masks are not supported)")
    attention_mask = attention_mask.to(device)
    within = None if documents is None else positions_in_documents(documents) * attention_mask
    bias = build_alibi(attention_mask, slopes, dtype, within)  # [b, n_local, 1, k]
    if divisor != 1.0:
        bias = bias / divisor
    keys = torch.arange(total, device=device)
    visible = (keys[None, :] <= past + torch.arange(length, device=device)[:, None])[None] \
        & attention_mask[:, None, :].bool()  # [b, s, k]
    if documents is not None:
        visible = visible & (documents[:, :, None] == documents[:, None, :])
    hidden = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.where(visible[:, None], bias, hidden)  # [b, n_local, s, k]
