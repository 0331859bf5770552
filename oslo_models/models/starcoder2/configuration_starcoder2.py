"""StarCoder2's config: ``transformers``' own class (same ``model_type``, same ``config.json``), with its
``base_model_tp_plan``; this project's plan is derived from ``STARCODER2_SPEC``."""
from transformers import Starcoder2Config

__all__ = ["Starcoder2Config"]
