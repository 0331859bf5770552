"""ModernBERT's masked LM as pipeline stages: BERT's encoder stages (``bert/pipeline_bert.py``: the base model's own
phases on each stage's layers, one hidden-state tensor ``[mb, s(/tp), h]`` between stages) with ModernBERT's parts.

The first stage holds the embeddings (``tok_embeddings``, ``norm``, ``drop``), every stage the parameter-free
``rotary_emb`` (both bases), the last stage the ``final_norm``, the ``head`` and the vocab-parallel ``decoder`` (a copy
of the token embeddings when tied: the tied group keeps both copies equal, their gradients summed over the two
stages). The last stage returns the local logits ``[mb, s, V_padded/tp]``; the loss runs on the split vocabulary."""
from __future__ import annotations

from ..bert.pipeline_bert import EncoderPipelineAdapter, MaskedLMPipelineAdapter
from ..common import token_loss

EMBEDDING_PARTS = ("tok_embeddings", "norm", "drop")


class ModernBertMaskedLMPipelineAdapter(MaskedLMPipelineAdapter):
    batch_keys = ("input_ids", "labels", "attention_mask", "position_ids")

    @classmethod
    def of(cls, model_class: type) -> type:
        adapter = EncoderPipelineAdapter.of.__func__(cls, model_class)  # the decoder is the model's own
        adapter.head = ""
        return adapter

    @classmethod
    def head_modules_of(cls, model_class):
        return {"head": "head", "decoder": "decoder"}

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

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        if getattr(model.config, "tie_word_embeddings", False):
            return [(f"{self.base}.embeddings.tok_embeddings.weight", "decoder.weight")]
        return []

    def stage_forward(self, stage, x, attention_mask=None, position_ids=None):
        return super().stage_forward(stage, x, attention_mask, None, position_ids)

    def head_forward(self, stage, hidden):
        return stage.decoder(stage.head(hidden))  # [mb, s, V_padded/tp]

    def head_output_shape(self, model, mb, seq_len):
        return mb, seq_len, model.decoder.weight.shape[0]

    def loss(self, model, local_logits, labels, num_items_in_batch):
        return token_loss(local_logits, labels, model.decoder, num_items_in_batch=num_items_in_batch)
