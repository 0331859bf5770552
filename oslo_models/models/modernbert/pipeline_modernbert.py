"""ModernBERT's heads as pipeline stages: BERT's encoder stages (``bert/pipeline_bert.py``: the base model's own
phases on each stage's layers, one hidden-state tensor ``[mb, s(/tp), h]`` between stages) with ModernBERT's parts.

The first stage holds the embeddings (``tok_embeddings``, ``norm``, ``drop``), every stage the parameter-free
``rotary_emb`` (both bases), the last stage the ``final_norm`` and the head. Masked LM: the ``head`` and the
vocab-parallel ``decoder`` (a copy of the token embeddings when tied: the tied group keeps both copies equal, their
gradients summed over the two stages); the last stage returns the local logits ``[mb, s, V_padded/tp]`` and the loss
runs on the split vocabulary. Sequence / token classification, question answering and multiple choice: the head
class's own rule (``head``, ``drop``, ``classifier`` after the ``classifier_pooling`` pooling, which reads the
``attention_mask`` every stage receives: ``head_logits`` in ``modeling_modernbert.py``)."""
from __future__ import annotations

from ..bert.pipeline_bert import (
    EncoderPipelineAdapter,
    MaskedLMPipelineAdapter,
    MultipleChoicePipelineAdapter,
    QuestionAnsweringPipelineAdapter,
    SequenceClassificationPipelineAdapter,
    TokenClassificationPipelineAdapter,
)
from ..common import token_loss

EMBEDDING_PARTS = ("tok_embeddings", "norm", "drop")


class ModernBertStages:
    """The part of every ModernBERT head's adapter that differs from BERT's (mixed in before a BERT head adapter):
    its embedding parts, the rotary embedding on every stage, the final norm on the last, no token types."""

    def _embedding_modules(self, model) -> dict[str, str]:
        path = f"{self.base}.embeddings"
        return {"embeddings": path, **{f"embeddings_{part}": f"{path}.{part}" for part in EMBEDDING_PARTS}}

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        modules = {**super().stage_modules(model, layout, stage), "rotary_emb": f"{self.base}.rotary_emb"}
        if stage == layout.num_stages - 1:
            modules["final_norm"] = f"{self.base}.final_norm"
        return modules

    def optional_modules(self, model, layout) -> set[str]:
        return super().optional_modules(model, layout) | {f"{self.base}.final_norm"}

    def stage_forward(self, stage, x, attention_mask=None, token_type_ids=None, position_ids=None):
        return super().stage_forward(stage, x, attention_mask, None, position_ids)  # no token types


class ModernBertMaskedLMPipelineAdapter(ModernBertStages, MaskedLMPipelineAdapter):
    batch_keys = ("input_ids", "labels", "attention_mask", "position_ids")

    @classmethod
    def of(cls, model_class: type) -> type:
        adapter = EncoderPipelineAdapter.of.__func__(cls, model_class)  # the decoder is the model's own
        adapter.head = ""
        return adapter

    @classmethod
    def head_modules_of(cls, model_class):
        return {"head": "head", "decoder": "decoder"}

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        if getattr(model.config, "tie_word_embeddings", False):
            return [(f"{self.base}.embeddings.tok_embeddings.weight", "decoder.weight")]
        return []

    def head_forward(self, stage, hidden):
        return stage.decoder(stage.head(hidden))  # [mb, s, V_padded/tp]

    def head_output_shape(self, model, mb, seq_len):
        return mb, seq_len, model.decoder.weight.shape[0]

    def loss(self, model, local_logits, labels, num_items_in_batch):
        return token_loss(local_logits, labels, model.decoder, num_items_in_batch=num_items_in_batch)


class ModernBertSequenceClassificationPipelineAdapter(ModernBertStages, SequenceClassificationPipelineAdapter):
    pass


class ModernBertTokenClassificationPipelineAdapter(ModernBertStages, TokenClassificationPipelineAdapter):
    pass


class ModernBertQuestionAnsweringPipelineAdapter(ModernBertStages, QuestionAnsweringPipelineAdapter):
    pass


class ModernBertMultipleChoicePipelineAdapter(ModernBertStages, MultipleChoicePipelineAdapter):
    pass
