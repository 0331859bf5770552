"""T5's parallel plan: one plan for ``T5Model``, ``T5ForConditionalGeneration`` and ``T5EncoderModel`` (patterns a
class does not have simply match nothing). ``*`` stands for the stack (``encoder``/``decoder``), the block index
and the sub-layer index (self-attention 0, cross-attention 1 in the decoder, feed-forward last).

- attention ``q/k/v`` column-parallel, ``o`` row-parallel: rank r owns heads ``r*n/tp .. (r+1)*n/tp``;
- ``relative_attention_bias`` (``[num_buckets, n]``) split along its heads dim, the same heads;
- feed-forward ``wi`` / ``wi_0`` / ``wi_1`` column-parallel, ``wo`` row-parallel;
- embeddings (``shared`` and the stacks' tied ``embed_tokens``) and ``lm_head`` vocab-parallel;
- the RMS norms are sequence-parallel aware; residual dropouts split their RNG stream under sequence
  parallelism, dropouts on split heads / FFN columns always do.
"""
from __future__ import annotations

from ...parallel_layers.head_parallel import HeadwiseEmbedding
from ...parallel_layers.plan import Colwise, ParallelPlan, Rowwise, TPDropout, VocabEmbedding
from ..common import SequenceParallelRMSNormStyle

_LAYER = "*.block.*.layer.*"
T5_STYLES = {
    "shared": VocabEmbedding(),
    "*.embed_tokens": VocabEmbedding(),
    "*.dropout": TPDropout(),
    "*.final_layer_norm": SequenceParallelRMSNormStyle(),
    f"{_LAYER}.layer_norm": SequenceParallelRMSNormStyle(),
    f"{_LAYER}.dropout": TPDropout(),
    f"{_LAYER}.*.q": Colwise(),
    f"{_LAYER}.*.k": Colwise(),
    f"{_LAYER}.*.v": Colwise(),
    f"{_LAYER}.*.o": Rowwise(),
    f"{_LAYER}.*.relative_attention_bias": HeadwiseEmbedding(),
    f"{_LAYER}.*.dropout": TPDropout(always_split=True),  # attention probs and the FFN's inner dropout
    f"{_LAYER}.DenseReluDense.wi": Colwise(),
    f"{_LAYER}.DenseReluDense.wi_0": Colwise(),
    f"{_LAYER}.DenseReluDense.wi_1": Colwise(),
    f"{_LAYER}.DenseReluDense.wo": Rowwise(),
    "lm_head": Colwise(vocab=True),
}

T5_PLAN = ParallelPlan(T5_STYLES)
