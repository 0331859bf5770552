"""OPT's config: ``transformers.OPTConfig`` itself (same ``model_type``, same ``config.json``)."""
from transformers import OPTConfig

__all__ = ["OPTConfig"]
