"""RoBERTa's masked LM as pipeline stages: BERT's adapter (``bert/pipeline_bert.py``) under RoBERTa's names.

The embeddings module derives RoBERTa's position ids from ``input_ids`` (``padding_idx``) on the first stage, so
only the paths differ: the encoder under ``roberta``, the head ``lm_head`` (dense, GELU, ``layer_norm``, the
vocab-parallel decoder tied to the word embeddings).
"""
from __future__ import annotations

from ..bert.pipeline_bert import BertMLMPipelineAdapter


class RobertaMLMPipelineAdapter(BertMLMPipelineAdapter):
    base = "roberta"
    layer_paths = ("roberta.encoder.layer",)
    head = "lm_head"
    head_modules = {"lm_head": head, "decoder": f"{head}.decoder"}
