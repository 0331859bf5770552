"""RoBERTa's parallel plan is BERT's (derived from ``BERT_SPEC``, see ``bert/parallel_plan.py``); its MLM head
``RobertaLMHead`` carries the vocab-parallel ``lm_head.decoder`` with ``lm_head.bias`` split alongside it, and the
classification heads are replicated."""
from __future__ import annotations

from ..bert.parallel_plan import published_tp_plan

__all__ = ["published_tp_plan"]
