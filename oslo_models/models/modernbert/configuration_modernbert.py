"""ModernBERT's configuration is ``transformers``' own (``layer_types``, ``local_attention`` -> ``sliding_window``,
``rope_parameters`` per attention type are standardized there)."""
from transformers import ModernBertConfig

__all__ = ["ModernBertConfig"]
