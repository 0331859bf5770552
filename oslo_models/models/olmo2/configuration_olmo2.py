"""OLMo 2's config: ``transformers``' own class, with its own ``base_model_tp_plan`` (q/k/v gathered, because the
q/k norms span all heads); this project splits those norms across ranks instead (``common/norms/full_width_norm.py``), a
layout ``transformers``' plan strings cannot name, so nothing of ours is published here."""
from transformers import Olmo2Config

__all__ = ["Olmo2Config"]
