"""RoBERTa's parallel plan: BERT's encoder plan under the ``roberta`` prefix, the vocab-parallel MLM decoder at
``lm_head.decoder`` with ``lm_head.bias`` split alongside it, and replicated classification heads."""
from __future__ import annotations

from ...parallel_layers.plan import ParallelPlan
from ..bert.parallel_plan import ENCODER_STYLES, mlm_head_styles, prefixed

ROBERTA_BASE_PLAN = ParallelPlan(ENCODER_STYLES)
ROBERTA_MLM_PLAN = ParallelPlan({**prefixed("roberta", ENCODER_STYLES), **mlm_head_styles("lm_head")})
ROBERTA_HEAD_PLAN = ParallelPlan(prefixed("roberta", ENCODER_STYLES))
