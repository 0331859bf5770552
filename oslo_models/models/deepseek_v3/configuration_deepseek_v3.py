"""DeepSeek-V3's config: ``transformers``' own class (same ``model_type``, same ``config.json``); this project's
plan is derived from ``DEEPSEEK_V3_SPEC``."""
from transformers import DeepseekV3Config

__all__ = ["DeepseekV3Config"]
