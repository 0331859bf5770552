"""DeBERTa-v2's heads as pipeline stages: BERT's encoder stages (``bert/pipeline_bert.py``: the base model's own
phases on each stage's layers, one hidden-state tensor ``[mb, s(/tp), h]`` between stages, the head on the last).

What differs: the embedding parts a config has (absolute positions, token types and ``embed_proj`` are optional), and
the shared relative embeddings. Every stage's layers read ``encoder.rel_embeddings`` (and its ``LayerNorm``), so
every stage holds a copy; the copies are tied groups of the pipeline: each stage adds its layers' gradient and the
copies' gradients are summed over the stages (one all-reduce each), which keeps them equal after every step.

The heads: the masked LM (the legacy ``cls.predictions``), token classification and question answering are BERT's;
sequence classification and multiple choice run the head class's own rule (``ContextPooler`` on the first token,
``dropout``, ``classifier``: ``pipeline_head_modules`` / ``head_logits`` in ``modeling_deberta_v2.py``), and
sequence classification keeps DeBERTa's loss rule (class indices ``< 0`` ignored, not only ``-100``)."""
from __future__ import annotations

import torch

from ..bert.pipeline_bert import (
    MaskedLMPipelineAdapter,
    MultipleChoicePipelineAdapter,
    QuestionAnsweringPipelineAdapter,
    SequenceClassificationPipelineAdapter,
    TokenClassificationPipelineAdapter,
)


class DebertaV2Stages:
    """The part of every DeBERTa-v2 head's adapter that differs from BERT's (mixed in before a BERT head adapter):
    the embedding parts, and the relative embeddings on every stage as tied copies."""

    def _embedding_parts(self, config) -> tuple[str, ...]:
        parts = ["word_embeddings", "LayerNorm", "dropout"]
        if getattr(config, "position_biased_input", True):
            parts.append("position_embeddings")
        if config.type_vocab_size > 0:
            parts.append("token_type_embeddings")
        if getattr(config, "embedding_size", config.hidden_size) != config.hidden_size:
            parts.append("embed_proj")
        return tuple(parts)

    def _embeddings_of(self, config) -> dict[str, str]:
        path = f"{self.base}.embeddings"
        return {"embeddings": path, **{f"embeddings_{p}": f"{path}.{p}" for p in self._embedding_parts(config)}}

    def _relative_parts(self, config) -> dict[str, str]:
        """The encoder's shared relative-position modules: on every stage."""
        parts = {}
        if getattr(config, "relative_attention", False):
            parts["rel_embeddings"] = f"{self.base}.encoder.rel_embeddings"
            if "layer_norm" in getattr(config, "norm_rel_ebd", "none").lower():
                parts["rel_norm"] = f"{self.base}.encoder.LayerNorm"
        return parts

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        modules = self._embeddings_of(model.config) if stage == 0 else {}
        if stage == layout.num_stages - 1:
            modules.update(self.head_modules)
        return {**modules, **self._relative_parts(model.config)}

    def optional_modules(self, model, layout) -> set[str]:
        parts = set(self._embeddings_of(model.config).values()) - {f"{self.base}.embeddings"}
        return self._outermost(parts | set(self.head_modules.values()))

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        shared = []
        for key, path in self._relative_parts(model.config).items():
            names = ("weight",) if key == "rel_embeddings" else ("weight", "bias")
            shared.extend((f"{path}.{name}",) for name in names)
        return super().tied_groups(model) + shared


class DebertaV2MaskedLMPipelineAdapter(DebertaV2Stages, MaskedLMPipelineAdapter):
    pass


class DebertaV2SequenceClassificationPipelineAdapter(DebertaV2Stages, SequenceClassificationPipelineAdapter):
    """``logits [mb, num_labels]``; the loss is ``deberta_classification_loss`` (with ``problem_type`` unset: the
    mean over the rows whose class index is ``>= 0``, regression for one label, soft targets for ``[b, n]``
    labels) as this microbatch's share of the whole batch's mean."""

    def _items(self, config, labels: torch.Tensor) -> int:
        if config.problem_type is not None:  # the common rule
            return super().num_loss_items(labels)
        if labels.is_floating_point():  # regression or soft targets: a mean over the rows
            return labels.shape[0]
        return int((labels >= 0).sum())  # class indices: DeBERTa keeps the rows >= 0

    def loss_items(self, model, labels: torch.Tensor) -> int:
        return self._items(model.config, labels)

    def loss(self, model, logits, labels, num_items_in_batch):
        from .modeling_deberta_v2 import deberta_classification_loss  # (modeling imports this module)

        items = self._items(model.config, labels)
        if not items:  # every row of this microbatch ignored: it adds nothing
            return logits.sum() * 0.0
        return deberta_classification_loss(logits, labels, model.config) * (items / num_items_in_batch)


class DebertaV2TokenClassificationPipelineAdapter(DebertaV2Stages, TokenClassificationPipelineAdapter):
    pass


class DebertaV2QuestionAnsweringPipelineAdapter(DebertaV2Stages, QuestionAnsweringPipelineAdapter):
    pass


class DebertaV2MultipleChoicePipelineAdapter(DebertaV2Stages, MultipleChoicePipelineAdapter):
    pass
