"""DeBERTa-v2's configuration is ``transformers``' own (``pos_att_type`` strings are split into lists there)."""
from transformers import DebertaV2Config

__all__ = ["DebertaV2Config"]
