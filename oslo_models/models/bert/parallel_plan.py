"""BERT's parallel plan (RoBERTa and its variants share it) is derived from ``BERT_SPEC`` (``modeling_bert.py``):
the components carry their fragments. Encoder layers are Megatron-split: ``BertAttention`` carries
``query/key/value`` column-parallel (rank r owns heads ``r*n/tp .. (r+1)*n/tp``) and ``output.dense``
row-parallel, ``BertIntermediate`` its column-parallel ``dense``, ``BertOutput`` its row-parallel ``dense``. BERT is
post-LN, so the norms after each residual add see sequence-split activations under sequence parallelism and are
sequence-parallel aware. ``BertEmbeddings`` carries the vocab-parallel word embeddings and its replicated position
and token-type tables, LayerNorm and dropout. The MLM heads carry theirs (``BertLMPredictionHead``,
``RobertaLMHead``: the vocab-parallel decoder, and the decoder's own bias split like its outputs); the pooler and
the classification heads are replicated.

``published_tp_plan`` is what the configs' ``base_model_tp_plan`` publishes, from the same spec."""
from __future__ import annotations

from ..common.rules.published_plan import PublishedTPPlan


def published_tp_plan() -> PublishedTPPlan:
    return PublishedTPPlan("oslo_models.models.bert.modeling_bert", "BERT_SPEC")


def prefixed(prefix: str, styles: dict) -> dict:
    """``styles`` with every pattern under ``prefix`` (an empty pattern: the prefix itself); T5's heads use it."""
    return {f"{prefix}.{pattern}" if pattern else prefix: style for pattern, style in styles.items()}
