"""BERT's parallel plan (RoBERTa shares the encoder part): the one place that says how each module is split.

Encoder layers are Megatron-split: ``query/key/value`` and ``intermediate.dense`` column-parallel (rank r owns
heads ``r*n/tp .. (r+1)*n/tp`` and a slice of the FFN), ``attention.output.dense`` and ``output.dense``
row-parallel. BERT is post-LN, so the norms after each residual add see sequence-split activations under sequence
parallelism and get ``SequenceParallelNorm``. The embedding sum, its LayerNorm and dropout, the pooler and the
MLM transform (dense + LayerNorm) are replicated; the word embeddings and the (tied) MLM decoder are split over
the vocabulary, and the decoder's own bias (``cls.predictions.bias``) is split like the decoder's outputs.
"""
from __future__ import annotations

from ...parallel_layers.head_parallel import VocabBias
from ...parallel_layers.plan import (
    Colwise,
    ParallelPlan,
    PositionEmbedding,
    Rowwise,
    SequenceParallelNorm,
    StreamLinear,
    TPDropout,
    VocabEmbedding,
)

ENCODER_STYLES = {  # relative to BertModel / RobertaModel
    "embeddings.word_embeddings": VocabEmbedding(),
    "embeddings.position_embeddings": PositionEmbedding(),  # replicated at 1D; hidden-split at 2D/2.5D
    "embeddings.token_type_embeddings": PositionEmbedding(),
    "embeddings.LayerNorm": SequenceParallelNorm(),  # called without sequence_parallel: a plain norm at 1D
    "embeddings.dropout": TPDropout(),
    "encoder.layer.*.attention.self.query": Colwise(),
    "encoder.layer.*.attention.self.key": Colwise(),
    "encoder.layer.*.attention.self.value": Colwise(),
    "encoder.layer.*.attention.self.dropout": TPDropout(always_split=True),
    "encoder.layer.*.attention.output.dense": Rowwise(),
    "encoder.layer.*.attention.output.dropout": TPDropout(),
    "encoder.layer.*.attention.output.LayerNorm": SequenceParallelNorm(),
    "encoder.layer.*.intermediate.dense": Colwise(),
    "encoder.layer.*.output.dense": Rowwise(),
    "encoder.layer.*.output.dropout": TPDropout(),
    "encoder.layer.*.output.LayerNorm": SequenceParallelNorm(),
}


def prefixed(prefix: str, styles: dict) -> dict:
    return {f"{prefix}.{pattern}": style for pattern, style in styles.items()}


def mlm_head_styles(head: str) -> dict:
    """The vocab-parallel decoder of an MLM head at ``head`` and the vocab-sized bias the head itself owns."""
    return {head: VocabBias(), f"{head}.decoder": Colwise(vocab=True),
            f"{head}.transform.dense": StreamLinear(), f"{head}.transform.LayerNorm": SequenceParallelNorm()}


BERT_BASE_PLAN = ParallelPlan(ENCODER_STYLES)
BERT_MLM_PLAN = ParallelPlan({**prefixed("bert", ENCODER_STYLES), **mlm_head_styles("cls.predictions")})
BERT_HEAD_PLAN = ParallelPlan(prefixed("bert", ENCODER_STYLES))  # replicated classification / QA heads
