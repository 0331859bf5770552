"""``GroupedQueryAttention`` variants whose plan fragment differs from the Llama one, so they are classes of their
own (a family's ``StackSpec`` names the class, and the plan is read from it):

- ``SinkAttention`` (gpt-oss): a learned per-head logit ``sinks [n]`` joins each query's softmax as one extra
  column and is dropped after it (``transformers``' gpt-oss ``eager_attention_forward`` reads ``module.sinks``;
  the flash/flex kernels take it as ``s_aux=``). Under TP the parameter is split by query heads exactly like
  ``q_proj``'s output (``HeadParameters``: rank ``r`` holds ``sinks[r*n/tp:(r+1)*n/tp]``); each head's sink is used
  only on its rank, so it needs no collective in either direction. Under context parallelism the ring /
  all-to-all cores take it as ``s_aux`` and add it to each row's denominator once, at the final merge.
- ``FullWidthQKNormAttention`` (OLMo 2): RMS norms over the whole ``q_proj``/``k_proj`` output (``n*d`` and
  ``n_kv*d`` wide), before the heads are split and before rotary; under TP their statistic is all-reduced
  (``full_width_norm.py``).
- ``PackedQKVAttention`` (Phi-3): one ``qkv_proj`` ``[(n + 2 n_kv) * d, h]`` packing q|k|v of unequal sizes under
  grouped-query attention. Under TP (``PackedKVHeadColwise``, ``parallel_layers/kv_heads.py``) each rank holds its
  ``n/tp`` query heads and the key/value heads they read from each block (replicated when ``tp > n_kv``), so the
  local output splits into q|k|v with no communication.

Shapes as ``GroupedQueryAttention``: input/output ``[b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ....parallel_layers.context_parallel import ContextParallelMask
from ....parallel_layers.kv_heads import PackedHeadsLinear, PackedKVHeadColwise
from ....parallel_layers.layers import Linear
from ....parallel_layers.plan import Rowwise, Style, TPDropout, refuse_grid_mode
from ....parallel_layers.sharding import EvenSplit
from ..norms.full_width_norm import FullWidthRMSNorm, FullWidthRMSNormStyle
from .attention import GroupedQueryAttention, split_heads


@dataclass(frozen=True)
class HeadParameters(Style):
    """Plan style of a module holding per-query-head parameters of its own (``names``, each ``[n, ...]``): the module
    stays, each named parameter is cut to this rank's ``n/tp`` heads (dim 0, contiguous, as ``Colwise`` cuts
    ``q_proj``). A parameter holding real values keeps this rank's slice of them; on the meta device the loader
    fills it from ``shard_specs``. No collective: a head's parameter is read only on its rank. 1D only; not
    published (``transformers`` plans name modules, not parameters)."""

    names: tuple[str, ...] = ()
    hf_style = None

    def build(self, module, context):
        refuse_grid_mode(context, f"per-head parameters {self.names}")
        for name in self.names:
            full = getattr(module, name)
            local = EvenSplit(0).read_shard(tuple(full.shape), full.data.__getitem__, context.tp_rank, context.tp_size)
            setattr(module, name, nn.Parameter(local.clone(), requires_grad=full.requires_grad))
        return module

    def shard_specs(self, module):
        return {name: EvenSplit(0) for name in self.names}


class SinkAttention(GroupedQueryAttention):
    """``GroupedQueryAttention`` with gpt-oss's learned attention sinks ``sinks [n]`` (``[n/tp]`` on a TP rank). The
    eager kernel is ``transformers``' gpt-oss one; SDPA cannot take sinks (``transformers`` drops ``s_aux`` there),
    so it is refused; the context-parallel cores take the sinks (``parallel_layers/context_parallel``)."""

    kernels = frozenset({"flash_attn", "flex_attn", "attention_backend"})

    tp_plan = {**GroupedQueryAttention.tp_plan, "": HeadParameters(names=("sinks",))}

    def __init__(self, config, layer_idx: int, **options):
        if options.get("eager_fallback") is None:
            from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

            options["eager_fallback"] = eager_attention_forward
        super().__init__(config, layer_idx, **options)
        self.sinks = nn.Parameter(torch.zeros(config.num_attention_heads))

    def kernel_kwargs(self, attention_mask) -> dict:
        if self.config._attn_implementation == "sdpa" and not isinstance(attention_mask, ContextParallelMask):
            raise ValueError("attention sinks need the eager, flex or flash attention kernels; SDPA would drop them "
                             "(set attn_implementation='eager')")
        return {**super().kernel_kwargs(attention_mask), "s_aux": self.sinks}


class FullWidthQKNormAttention(GroupedQueryAttention):
    """``GroupedQueryAttention`` with OLMo 2's q/k norms: ``q_norm`` over ``n*d`` and ``k_norm`` over ``n_kv*d``
    (``FullWidthRMSNorm``, the ``"olmo2"`` formula), applied to the projections' outputs ``[b, s, (n/tp)*d]`` before
    the head split and rotary. Under TP each norm's weight is split like its projection and its statistic is
    all-reduced over TP (one all-reduce of ``[b, s, 1]`` per norm, forward and backward)."""

    tp_plan = {**GroupedQueryAttention.tp_plan, "q_norm": FullWidthRMSNormStyle(), "k_norm": FullWidthRMSNormStyle()}

    def __init__(self, config, layer_idx: int, **options):
        if options.pop("qk_norm", False):
            raise ValueError("FullWidthQKNormAttention has its own q/k norms; leave qk_norm off")
        super().__init__(config, layer_idx, **options)
        num_heads, num_kv, eps = config.num_attention_heads, config.num_key_value_heads, config.rms_norm_eps
        self.q_norm = FullWidthRMSNorm(num_heads * self.head_dim, eps, num_heads=num_heads)
        self.k_norm = FullWidthRMSNorm(num_kv * self.head_dim, eps, num_heads=num_kv)

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query = split_heads(self.q_norm(self.q_proj(hidden_states)), self.head_dim)  # [b, n/tp, s, d]
        key = split_heads(self.k_norm(self.k_proj(hidden_states)), self.head_dim)  # [b, n_kv/tp, s, d]
        value = split_heads(self.v_proj(hidden_states), self.head_dim)
        return query, key, value


class PackedQKVAttention(GroupedQueryAttention):
    """``GroupedQueryAttention`` whose q|k|v come from one fused projection ``qkv_proj`` (Phi-3; keys as
    ``Phi3Attention``, registered in its order: ``o_proj``, then ``qkv_proj``). Its local output
    ``[b, s, (n/tp + 2 * max(n_kv/tp, 1)) * d]`` is split by ``qkv_proj.blocks`` into query, key and value heads;
    everything after (rotary, partial or full; cache; kernel; ``o_proj``) is ``GroupedQueryAttention``'s. No q/k
    norms (no family packs q|k|v and norms them)."""

    tp_plan = {"qkv_proj": PackedKVHeadColwise(), "o_proj": Rowwise(), "attn_dropout": TPDropout(always_split=True)}

    def __init__(self, config, layer_idx: int, **options):
        if options.get("qk_norm"):
            raise ValueError("PackedQKVAttention has no q/k norms; leave qk_norm off")
        super().__init__(config, layer_idx, **options)

    def build_projections(self, hidden_size, num_heads, num_kv, *, qkv_bias, o_bias):
        self.o_proj = Linear(num_heads * self.head_dim, hidden_size, bias=o_bias)
        self.qkv_proj = PackedHeadsLinear(hidden_size, head_counts=(num_heads, num_kv, num_kv),
                                          head_dim=self.head_dim, bias=qkv_bias)

    @property
    def num_key_value_groups(self) -> int:
        query, key, _ = self.qkv_proj.blocks
        return query // key

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = self.qkv_proj(hidden_states).split(self.qkv_proj.blocks, dim=-1)
        return tuple(split_heads(part, self.head_dim) for part in (query, key, value))
