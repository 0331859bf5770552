"""Tiny Llama-shaped decoders (Llama, Mistral, Qwen2, Qwen3) for parity tests, built with ``transformers`` from a
fixed seed and saved in Hub format. Their sizes and switches are the family records' tiny configs
(``tests/helpers/zoo.py``; ``TINY_DECODER`` and ``decoder_record`` in ``oslo_models/models/llama/__init__.py``).
Every switch the family code has is on in at least one of them:

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
from tests.helpers import zoo

TYPES = ("llama", "mistral", "qwen2", "qwen3")
VOCAB = zoo.tiny_kwargs("llama")["vocab_size"]  # 101, the same for the four
assert {zoo.tiny_kwargs(t)["vocab_size"] for t in TYPES} == {VOCAB} and VOCAB % 2 == 1


def tiny_config(model_type: str, **overrides):
    return zoo.tiny_config(model_type, **overrides)


def hf_class(model_type: str, head: str = "ForCausalLM"):
    """``transformers``' class, e.g. ``hf_class("qwen2", "ForSequenceClassification")``."""
    return getattr(transformers, f"{zoo.class_prefix(model_type)}{head}")


def om_class(model_type: str, head: str = "ForCausalLM"):
    return getattr(om, f"{zoo.class_prefix(model_type)}{head}")


def save_tiny(path, model_type: str, head: str = "ForCausalLM", *, seed: int = 0, **overrides) -> str:
    torch.manual_seed(seed)
    hf_class(model_type, head)(tiny_config(model_type, **overrides)).save_pretrained(path)
    return str(path)


def save_all(root) -> dict[str, str]:
    """One causal-LM checkpoint per type under ``root``: ``{model_type: path}``."""
    return {t: save_tiny(root / t, t) for t in TYPES}
