"""The Llama-shaped decoders' parallel plan is derived from ``LLAMA_SPEC`` (``modeling_llama.py``): each component
carries its fragment (``GroupedQueryAttention``: q column-parallel, k/v key/value-head-parallel (replicated when
``tp > n_kv``), o row-parallel, Qwen3's q/k norms with gradients summed over TP; ``GatedMLP``: gate/up column-,
down row-parallel; ``RMSNorm``: sequence-parallel aware), the stack adds the vocab-parallel ``embed_tokens`` and the
final ``norm``, the causal LM head its vocab-parallel ``lm_head``; classification heads stay replicated.

What the config classes publish as ``base_model_tp_plan`` (``transformers``' vocabulary) is read from the same
spec: ``published_tp_plan``."""
from __future__ import annotations

from ..common.rules.published_plan import PublishedTPPlan

QK_NORMS = ("layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm")


def published_tp_plan(qk_norm: bool = False) -> PublishedTPPlan:
    """``base_model_tp_plan`` for a config class (Qwen3's lists the q/k norms)."""
    return PublishedTPPlan("oslo_models.models.llama.modeling_llama", "LLAMA_SPEC", drop=() if qk_norm else QK_NORMS)
