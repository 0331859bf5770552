"""Qwen3-MoE's config: ``transformers``' own class (same ``model_type``, same ``config.json``), with its
``base_model_tp_plan`` / ``base_model_ep_plan``; this project's plan is derived from ``MOE_SPEC``."""
from transformers import Qwen3MoeConfig

__all__ = ["Qwen3MoeConfig"]
