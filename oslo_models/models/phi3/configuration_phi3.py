"""Phi-3's config: ``transformers``' own class (same ``model_type``, same ``config.json``; its legacy ``rope_scaling``
spellings (``su``, ``yarn`` -> ``longrope``) are standardized by it on load). Its ``base_model_tp_plan`` stays
``transformers``' (which gathers the fused q|k|v); this project's plan is derived from ``PHI3_SPEC``."""
from transformers import Phi3Config

__all__ = ["Phi3Config"]
