"""T5's parallel plan: one plan for ``T5Model``, ``T5ForConditionalGeneration`` and ``T5EncoderModel`` (patterns a
class does not have simply match nothing). ``*`` stands for the stack (``encoder``/``decoder``), the block index
and the sub-layer index (self-attention 0, cross-attention 1 in the decoder, feed-forward last).

- attention ``q/k/v`` column-parallel, ``o`` row-parallel: rank r owns heads ``r*n/tp .. (r+1)*n/tp``;
- ``relative_attention_bias`` (``[num_buckets, n]``) split along its heads dim, the same heads;
- feed-forward ``wi`` / ``wi_0`` / ``wi_1`` column-parallel, ``wo`` row-parallel;
- embeddings (``shared`` and the stacks' tied ``embed_tokens``) and ``lm_head`` vocab-parallel;
- the RMS norms are sequence-parallel aware; residual dropouts split their RNG stream under sequence
  parallelism, dropouts on split heads / FFN columns always do.

The attention's and the feed-forwards' styles are their components' ``tp_plan`` fragments (``T5Attention.tp_plan``
is ``T5_ATTENTION_PLAN``; ``DenseActDense`` / ``DenseGatedActDense`` carry theirs in ``common/feed_forward/mlp.py``).
"""
from __future__ import annotations

from ...parallel_layers.head_parallel import HeadwiseEmbedding
from ...parallel_layers.plan import Colwise, ParallelPlan, Rowwise, TPDropout, VocabEmbedding
from ..common import DenseActDense, DenseGatedActDense, SequenceParallelRMSNormStyle

#: ``T5Attention.tp_plan`` (the component carries it; defined here, where the config can import it without a cycle)
T5_ATTENTION_PLAN = {
    "q": Colwise(),
    "k": Colwise(),
    "v": Colwise(),
    "o": Rowwise(),
    "relative_attention_bias": HeadwiseEmbedding(),
    "dropout": TPDropout(always_split=True),  # attention probabilities of this rank's heads
}

_LAYER = "*.block.*.layer.*"


def feed_forward_styles(attribute: str, *fragments: dict) -> dict:
    """The feed-forward's styles under ``attribute`` (``DenseReluDense``; Switch Transformers' ``mlp``) from the
    ``tp_plan`` fragments of the modules that can fill it."""
    return {f"{_LAYER}.{attribute}.{pattern}": style for fragment in fragments for pattern, style in fragment.items()}


T5_STYLES = {
    "shared": VocabEmbedding(),
    "*.embed_tokens": VocabEmbedding(),
    "*.dropout": TPDropout(),
    "*.final_layer_norm": SequenceParallelRMSNormStyle(),
    f"{_LAYER}.layer_norm": SequenceParallelRMSNormStyle(),
    f"{_LAYER}.dropout": TPDropout(),  # the sub-layers' residual dropouts
    **{f"{_LAYER}.*.{pattern}": style for pattern, style in T5_ATTENTION_PLAN.items()},  # SelfAttention/EncDecAttention
    **feed_forward_styles("DenseReluDense", DenseActDense.tp_plan, DenseGatedActDense.tp_plan),
    "lm_head": Colwise(vocab=True),
}

T5_PLAN = ParallelPlan(T5_STYLES)
