"""DeBERTa's disentangled self-attention (``transformers``' ``DisentangledSelfAttention``, DeBERTa-v2/v3), split by
heads, as a block component.

Scores are content-to-content plus the relative terms, each divided by ``sqrt(d * (1 + #terms))``:

- content-to-position (``"c2p"`` in ``pos_att_type``): ``q_i . pos_k[clamp(delta(i, j) + span)]``;
- position-to-content (``"p2c"``): ``k_j . pos_q[clamp(span - delta(j, i))]``;

with ``delta(i, j) = i - j`` put in log buckets when ``position_buckets > 0`` (``transformers``'
``build_relative_position``), ``span`` the bucket count (or ``max_relative_positions``), and ``pos_k`` / ``pos_q``
the shared relative embeddings ``[2 span, h]`` (the encoder's ``rel_embeddings``, after its LayerNorm when
``norm_rel_ebd`` says ``layer_norm``) projected by ``key_proj`` / ``query_proj`` (``share_att_key``, DeBERTa-v3) or
by their own ``pos_key_proj`` / ``pos_query_proj``. Padding masks both queries and keys (``m_i * m_j``), filled with
the dtype's minimum before the softmax, exactly as ``transformers`` does (so padded rows are uniform there too).

Tensor parallelism: every projection is column-parallel, so rank ``r`` owns heads ``r*n/tp .. (r+1)*n/tp`` of the
content *and* of the relative terms, and all of it runs locally; the output projection (``output.dense``) is
row-parallel and does the only forward reduction. The relative embeddings are replicated: each rank projects the
full table for its own heads with ``sequence_parallel=False`` (they are no slice of the sequence), so the projection's
backward all-reduces their gradient over TP; ``rel_embeddings`` and its LayerNorm then hold the whole gradient on
every rank. Under sequence parallelism the content projections gather the sequence (``[b, s/tp, h] -> [b, s, ...]``).

Context parallelism is refused: a chunk's relative terms need the positions of every key of other chunks inside
the ring / all-to-all core, which merges plain softmax blocks only.

Shapes: b batch, s sequence, n heads (n/tp here), d head dim (``attention_head_size``), P = 2 span.
"""
from __future__ import annotations

import torch
from torch import nn

from ....parallel_layers.layers import Dropout, Linear
from ....parallel_layers.plan import Colwise, TPDropout
from ..rules.parallel_rules import Heads
from .attention import AttentionModule, refuse_context_parallel, split_heads


def relative_span(config) -> tuple[int, int, int]:
    """``(position_buckets, max_relative_positions, span)`` as ``transformers`` reads them."""
    buckets = getattr(config, "position_buckets", -1)
    max_relative = getattr(config, "max_relative_positions", -1)
    if max_relative < 1:
        max_relative = config.max_position_embeddings
    return buckets, max_relative, buckets if buckets > 0 else max_relative


class DisentangledSelfAttention(AttentionModule):
    """``forward(hidden [b, s(/tp), h], mask [b, 1, s, s] bool, relative=(rel_embeddings [P', h] | None,
    relative_pos [1, s, s] | None))`` -> ``(context [b, s, (n/tp)*d], probabilities [b, n/tp, s, s])`` (kept for
    backward anyway; ``output_attentions`` records them).
    Module names and keys are ``transformers``'."""

    tp_plan = {"query_proj": Colwise(), "key_proj": Colwise(), "value_proj": Colwise(), "pos_key_proj": Colwise(),
               "pos_query_proj": Colwise(), "pos_dropout": TPDropout(), "dropout": TPDropout(always_split=True)}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("num_attention_heads", config.num_attention_heads)]

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = getattr(config, "attention_head_size",
                                           config.hidden_size // config.num_attention_heads)
        all_head_size = self.num_attention_heads * self.attention_head_size
        self.query_proj = Linear(config.hidden_size, all_head_size, bias=True)
        self.key_proj = Linear(config.hidden_size, all_head_size, bias=True)
        self.value_proj = Linear(config.hidden_size, all_head_size, bias=True)
        self.share_att_key = getattr(config, "share_att_key", False)
        self.pos_att_type = config.pos_att_type if config.pos_att_type is not None else []
        self.relative_attention = getattr(config, "relative_attention", False)
        if self.relative_attention:
            self.position_buckets, self.max_relative_positions, self.pos_ebd_size = relative_span(config)
            self.pos_dropout = Dropout(config.hidden_dropout_prob)
            if not self.share_att_key:
                if "c2p" in self.pos_att_type:
                    self.pos_key_proj = Linear(config.hidden_size, all_head_size, bias=True)
                if "p2c" in self.pos_att_type:
                    self.pos_query_proj = Linear(config.hidden_size, all_head_size)
        self.dropout = Dropout(config.attention_probs_dropout_prob)

    def _scale(self, dtype) -> torch.Tensor:
        factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
        return torch.sqrt(torch.tensor(self.attention_head_size, dtype=torch.float) * factor).to(dtype)

    def _positions(self, proj: nn.Module, rel_embeddings: torch.Tensor) -> torch.Tensor:
        """``[1, n/tp, P, d]``: this rank's heads of the projected relative table (replicated input, not a slice of
        the sequence: its gradient is all-reduced over TP by the projection's backward)."""
        return split_heads(proj(rel_embeddings, sequence_parallel=False), self.attention_head_size)

    def relative_scores(self, query, key, relative_pos, rel_embeddings, scale) -> torch.Tensor:
        """The c2p + p2c terms ``[b, n/tp, s, s]`` (already divided by ``scale``)."""
        span = self.pos_ebd_size
        rel_embeddings = rel_embeddings[:span * 2][None]  # [1, P, h]
        c2p, p2c = "c2p" in self.pos_att_type, "p2c" in self.pos_att_type
        pos_key = pos_query = None
        if c2p:
            pos_key = self._positions(self.key_proj if self.share_att_key else self.pos_key_proj, rel_embeddings)
        if p2c:
            pos_query = self._positions(self.query_proj if self.share_att_key else self.pos_query_proj,
                                        rel_embeddings)
        relative_pos = relative_pos.to(device=query.device, dtype=torch.long).reshape(query.shape[-2], -1)
        score = 0
        batch, heads, length = query.shape[:3]
        if c2p:  # q_i . pos_k[delta(i, j) + span]
            index = torch.clamp(relative_pos + span, 0, span * 2 - 1).expand(batch, heads, length, length)
            score = score + torch.gather(query @ pos_key.transpose(-1, -2), -1, index) / scale
        if p2c:  # k_j . pos_q[span - delta(j, i)], gathered on the key rows, then transposed to [query, key]
            index = torch.clamp(-relative_pos + span, 0, span * 2 - 1).expand(batch, heads, length, length)
            p2c_att = torch.gather(key @ pos_query.transpose(-1, -2), -1, index).transpose(-1, -2)
            score = score + p2c_att / scale
        return score

    def forward(self, hidden_states, attention_mask=None, relative=None, **kwargs):
        refuse_context_parallel(attention_mask, "DeBERTa's disentangled (relative-position) attention")
        size = self.attention_head_size
        query, key, value = (split_heads(proj(hidden_states), size)
                             for proj in (self.query_proj, self.key_proj, self.value_proj))  # [b, n/tp, s, d]
        scale = self._scale(query.dtype)
        scores = query @ (key.transpose(-1, -2) / scale)
        if self.relative_attention:
            rel_embeddings, relative_pos = relative
            rel_embeddings = self.pos_dropout(rel_embeddings, sequence_parallel=False)  # same mask on every rank
            scores = scores + self.relative_scores(query, key, relative_pos, rel_embeddings, scale)
        scores = scores.masked_fill(~attention_mask, torch.finfo(query.dtype).min)
        probs = self.dropout(torch.softmax(scores, dim=-1))
        context = (probs @ value).transpose(1, 2).contiguous()  # [b, s, n/tp, d]
        return context.reshape(*context.shape[:2], -1), probs  # probs: what output_attentions records
