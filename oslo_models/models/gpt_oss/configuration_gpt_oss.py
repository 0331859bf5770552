"""gpt-oss's config: ``transformers``' own class (same ``model_type``, same ``config.json``); this project's plan is
derived from ``GPT_OSS_SPEC``."""
from transformers import GptOssConfig

__all__ = ["GptOssConfig"]
