"""The parallel plan of Switch Transformers: T5's (``models/t5/parallel_plan.py``: attention heads, embeddings, head,
norms) plus its feed-forward, which is named ``mlp`` here (``DenseReluDense`` in T5):

- dense layers ``mlp.wi`` column-parallel, ``mlp.wo`` row-parallel (as T5's), their inner dropout on split columns;
- sparse layers: ``mlp.router.classifier`` replicated; ``mlp.experts`` (stacked ``wi [E, f, d]``, ``wo [E, d, f]``)
  split over the expert-parallel group in contiguous blocks of ``E/ep`` experts (``ExpertParallel``), not over
  tensor parallelism; the experts' dropout acts on whole activations that every tp rank holds alike, so it draws
  from the replicated stream (``TPDropout()``, not ``always_split``).

First match wins, so these patterns come before T5's.
"""
from __future__ import annotations

from ...parallel_layers.moe import ExpertParallel
from ...parallel_layers.plan import ParallelPlan, TPDropout
from ..common import DenseActDense
from ..t5.parallel_plan import T5_STYLES, feed_forward_styles

#: ``SwitchTransformersSparseMLP.tp_plan`` (defined here, where the config can import it without a cycle)
SPARSE_MLP_PLAN = {"experts": ExpertParallel(), "experts.dropout": TPDropout()}

SWITCH_STYLES = feed_forward_styles("mlp", SPARSE_MLP_PLAN, DenseActDense.tp_plan)

SWITCH_PLAN = ParallelPlan({**SWITCH_STYLES, **T5_STYLES})
