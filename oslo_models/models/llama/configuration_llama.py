"""The Llama-family configs: ``transformers``' own classes (same ``model_type``, same ``config.json``; old
``rope_scaling``/``rope_theta`` spellings are standardized by them on load), each with the published
``base_model_tp_plan`` of this project's plan (a class attribute, never serialized). ``base_model_pp_plan`` is
``transformers``' (embeddings, layers, final norm), which is how the pipeline adapter cuts these models too."""
from __future__ import annotations

import transformers

from .parallel_plan import published_tp_plan


class LlamaConfig(transformers.LlamaConfig):
    base_model_tp_plan = published_tp_plan()


class MistralConfig(transformers.MistralConfig):
    base_model_tp_plan = published_tp_plan()


class Qwen2Config(transformers.Qwen2Config):
    base_model_tp_plan = published_tp_plan()


class Qwen3Config(transformers.Qwen3Config):
    base_model_tp_plan = published_tp_plan(qk_norm=True)
