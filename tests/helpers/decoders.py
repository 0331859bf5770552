"""Tiny Llama-shaped decoders (Llama, Mistral, Qwen2, Qwen3) for parity tests, built with ``transformers`` from a
fixed seed and saved in Hub format. Every switch the family code has is on in at least one of them:

- all: grouped-query attention with 8 query / 2 key-value heads (so tp=4 replicates key/value heads);
- llama: ``attention_bias`` and ``mlp_bias`` (biases on q/k/v/o and the MLP), untied embeddings;
- mistral: ``sliding_window=3``, shorter than the test sequences, in every layer;
- qwen2: q/k/v biases, tied embeddings, sliding window on the layers past ``max_window_layers=1``;
- qwen3: q/k RMS norms, ``head_dim=12`` (not hidden/heads), untied.
"""
from __future__ import annotations

import torch
import transformers

import oslo_models as om

VOCAB = 101
TYPES = ("llama", "mistral", "qwen2", "qwen3")
_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             rms_norm_eps=1e-6)
_SWITCHES = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "mistral": dict(sliding_window=3),
    "qwen2": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1, tie_word_embeddings=True),
    "qwen3": dict(head_dim=12),
}
_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def tiny_config(model_type: str, **overrides):
    values = {**_BASE, **_SWITCHES[model_type], **overrides}
    return getattr(transformers, f"{_PREFIX[model_type]}Config")(**values)


def hf_class(model_type: str, head: str = "ForCausalLM"):
    """``transformers``' class, e.g. ``hf_class("qwen2", "ForSequenceClassification")``."""
    return getattr(transformers, f"{_PREFIX[model_type]}{head}")


def om_class(model_type: str, head: str = "ForCausalLM"):
    return getattr(om, f"{_PREFIX[model_type]}{head}")


def save_tiny(path, model_type: str, head: str = "ForCausalLM", *, seed: int = 0, **overrides) -> str:
    torch.manual_seed(seed)
    hf_class(model_type, head)(tiny_config(model_type, **overrides)).save_pretrained(path)
    return str(path)


def save_all(root) -> dict[str, str]:
    """One causal-LM checkpoint per type under ``root``: ``{model_type: path}``."""
    return {t: save_tiny(root / t, t) for t in TYPES}
