"""Multi-head latent attention (MLA, DeepSeek-V2/V3), written once, with ``transformers``' ``DeepseekV3Attention``
module names and keys:

- queries: ``q_proj [n*(d_nope+d_rope), h]`` when ``q_lora_rank`` is ``None``; else the low-rank path
  ``q_a_proj [r_q, h]`` (bias with ``attention_bias``) -> ``q_a_layernorm`` (RMS over ``r_q``) ->
  ``q_b_proj [n*(d_nope+d_rope), r_q]``;
- keys/values: ``kv_a_proj_with_mqa [r_kv + d_rope, h]`` gives the latent ``c_kv [b, s, r_kv]`` and one rotary key
  ``k_rope [b, s, d_rope]`` shared by every head; ``kv_a_layernorm`` (RMS over ``r_kv``) then
  ``kv_b_proj [n*(d_nope+d_v), r_kv]`` expand the latent to each head's ``k_nope`` and value;
- each head's query/key is ``nope | rope`` (``d_nope + d_rope`` wide, rotary on the last ``d_rope`` dims, in
  ``transformers``' interleaved or half-split layout per ``rope_interleave``); values are ``d_v`` wide, so
  ``o_proj [h, n*d_v]``;
- score scale ``(d_nope + d_rope) ** -0.5``, times ``mscale**2`` under yarn scaling with ``mscale_all_dim``
  (``transformers``' ``yarn_apply_mscale``, called, not copied); the yarn ``attention_factor`` on ``cos``/``sin``
  comes from the rotary module (``RotaryEmbedding``, i.e. ``transformers``' own);
- the cache holds the compressed ``c_kv [b, 1, s, r_kv]`` and ``k_rope [b, 1, s, d_rope]`` per layer, as there.

Tensor parallelism (the plan fragment ``tp_plan``): heads are split. ``q_proj`` / ``q_b_proj`` and ``kv_b_proj``
are column-parallel by heads (rank ``r`` holds heads ``r*n/tp .. (r+1)*n/tp``; their rows are head-major), ``o_proj``
row-parallel (its all-reduce is the forward's only collective). The down projections ``q_a_proj``,
``kv_a_proj_with_mqa`` and their norms are replicated: each rank computes the whole latent. Their gradients are
summed over TP: the latents reach ``q_b_proj``/``kv_b_proj``, whose column-parallel input all-reduces the gradient
in backward, and the shared rotary key, which every rank uses for its own heads only, enters the head-parallel
region through ``copy_to_tensor_parallel_region`` (identity forward, all-reduce backward). So every replicated
weight ends a backward with the whole gradient on every rank. The 2D/2.5D/3D modes are refused (the style), with
the reason.

Context parallelism: the latent and rotary key are computed per chunk, expanded to this rank's per-head keys
``[b, n/tp, s/cp, d_nope + d_rope]`` and values ``[b, n/tp, s/cp, d_v]``, and those go through the ring (one
``d_qk + d_v`` wide block per hop) or the all-to-all core, which take values narrower than keys. Rotary uses the
chunk's global positions. (Passing the compressed latent around the ring instead, ``r_kv + d_rope`` wide, would
send less but re-run ``kv_b_proj`` per block: not done.)

Sequence parallelism: the replicated down projections need every token, so the module all-gathers its ``[b, s/tp,
h]`` input once over tp and runs on the whole sequence as under plain tensor parallelism (the inner layers with the
sequence-parallel switch off); ``o_proj`` then reduce-scatters back to ``[b, s/tp, h]``. The gathered input's
gradient is whole and equal on every rank (every path above ends in an all-reduce), so its backward keeps this
rank's slice. Cost against plain TP: one all-gather in, a reduce-scatter instead of the all-reduce out.

Shapes: input/output ``[b, s, h]``; ``cos``/``sin`` ``[b, s, d_rope]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ....parallel_layers.layers import Dropout, Linear
from ....parallel_layers.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    group_size,
)
from ....parallel_layers.plan import Colwise, Rowwise, Style, TPDropout, refuse_grid_mode
from ....parallel_layers.sequence_parallel import SequenceParallelAware
from ..norms.rms_norm import RMSNorm
from ..rules.parallel_rules import Heads
from .attention import AttentionModule, attend


@dataclass(frozen=True)
class LatentAttentionStyle(Style):
    """Plan style of the MLA module itself: it keeps the tensor-parallel group (for the shared rotary key's backward
    all-reduce). No parameter of its own is split. 1D only."""

    hf_style = None

    def build(self, module, context):
        refuse_grid_mode(context, "multi-head latent attention")
        module.tp_group = context.tp_group
        return module


class MultiHeadLatentAttention(SequenceParallelAware, AttentionModule):
    """DeepSeek's multi-head latent attention (see the module docstring)."""

    tp_plan = {"": LatentAttentionStyle(), "q_proj": Colwise(), "q_b_proj": Colwise(), "kv_b_proj": Colwise(),
               "o_proj": Rowwise(), "attn_dropout": TPDropout(always_split=True)}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("num_attention_heads", config.num_attention_heads)]

    def __init__(self, config, layer_idx: int, **unused):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.tp_group = None  # set by LatentAttentionStyle under tensor parallelism
        self.is_causal = True
        heads, hidden, bias = config.num_attention_heads, config.hidden_size, bool(config.attention_bias)
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        # registered in transformers' order (q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a..., kv_b, o_proj)
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6, formula="llama")
            self.q_b_proj = Linear(self.q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6, formula="llama")
        self.kv_b_proj = Linear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = Linear(heads * self.v_head_dim, hidden, bias=bias)
        self.attn_dropout = Dropout(getattr(config, "attention_dropout", 0.0) or 0.0)
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        self.scaling = hf.yarn_apply_mscale(config.rope_parameters, self.qk_head_dim ** -0.5)
        self._rotate = hf.apply_rotary_pos_emb_interleave if config.rope_interleave else hf.apply_rotary_pos_emb
        self._eager_fallback = hf.eager_attention_forward

    #: the kernels repeat key/value heads by this: every query head has its own expanded key/value head
    num_key_value_groups = 1

    def queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[b, s, h]`` -> ``[b, n/tp, s, d_nope + d_rope]`` (before rotary)."""
        if self.q_lora_rank is None:
            query = self.q_proj(hidden_states)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        return query.view(*hidden_states.shape[:-1], -1, self.qk_head_dim).transpose(1, 2)

    def expand_kv(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``latent [b, 1, s, r_kv]`` (normed), ``k_rope [b, 1, s, d_rope]`` (rotated) -> this rank's key
        ``[b, n/tp, s, d_nope + d_rope]`` and value ``[b, n/tp, s, d_v]``."""
        batch, _, length, _ = latent.shape
        kv = self.kv_b_proj(latent).view(batch, length, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, value = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # every local head reads the one rotary key: its gradient is this rank's heads' share, summed over TP
        k_rope = copy_to_tensor_parallel_region(k_rope, self.tp_group)
        key = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return key, value

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask=None, past_key_values=None, **kwargs):
        if not (self.sequence_parallel_active() and group_size(self.tp_group) > 1):
            out, weights = self.heads_attention(hidden_states, position_embeddings, attention_mask, past_key_values,
                                                **kwargs)
            return self.o_proj(out), weights
        # sequence parallelism (module docstring): gather once, run on the whole sequence, reduce-scatter out
        whole = gather_from_sequence_parallel_region(hidden_states, self.tp_group, grad_is_partial=False)
        out, weights = self.sequence_parallel_region.run(False, self.heads_attention, whole, position_embeddings,
                                                         attention_mask, past_key_values, **kwargs)
        return self.o_proj(out, sequence_parallel=True), weights

    def heads_attention(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values,
                        **kwargs):
        """``[b, s, h]`` -> this rank's heads' attention output ``[b, s, n/tp * d_v]`` (before ``o_proj``)."""
        batch, length = hidden_states.shape[:2]
        query = self.queries(hidden_states)
        q_nope, q_rope = torch.split(query, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = torch.split(self.kv_a_proj_with_mqa(hidden_states),
                                     [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(batch, 1, length, self.kv_lora_rank)
        k_rope = k_rope.view(batch, 1, length, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        q_rope, k_rope = self._rotate(q_rope, k_rope, cos, sin)
        if past_key_values is not None:  # the compressed latent and rotary key are cached, as in transformers
            latent, k_rope = past_key_values.update(latent, k_rope, self.layer_idx)
        key, value = self.expand_kv(latent, k_rope)
        query = torch.cat([q_nope, q_rope], dim=-1)
        return attend(self, query, key, value, attention_mask, dropout=self.attn_dropout, scaling=self.scaling,
                      eager_fallback=self._eager_fallback, **kwargs)
