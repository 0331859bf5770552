"""DeBERTa-v2's heads as pipeline stages: the encoder stages every encoder head shares
(``common/pipeline/pipeline_encoder.py``: the base model's own phases on each stage's layers, one hidden-state tensor
``[mb, s(/tp), h]`` between stages, the head class's task rule on the last). What differs: the embedding parts a config
has (absolute positions, token types and ``embed_proj`` are optional), and the shared relative embeddings. Every
stage's layers read ``encoder.rel_embeddings`` (and its ``LayerNorm``), so every stage holds a copy; the copies are
tied groups of the pipeline: each stage adds its layers' gradient and the copies' gradients are summed over the
stages (one all-reduce each), which keeps them equal after every step. Sequence classification keeps DeBERTa's loss
rule (``DEBERTA_SEQUENCE_CLASSIFICATION``: class indices ``< 0`` ignored, not only ``-100``)."""
from __future__ import annotations

import torch

from ..common.loss.head_rules import SequenceClassificationRule


class DebertaV2Stages:
    """``pipeline_stages`` of every DeBERTa-v2 head (mixed in before ``EncoderPipelineAdapter``): the embedding parts,
    and the relative embeddings on every stage as tied copies."""

    def _embedding_parts(self, model) -> tuple[str, ...]:
        config = model.config
        parts = ["word_embeddings", "LayerNorm", "dropout"]
        if getattr(config, "position_biased_input", True):
            parts.append("position_embeddings")
        if config.type_vocab_size > 0:
            parts.append("token_type_embeddings")
        if getattr(config, "embedding_size", config.hidden_size) != config.hidden_size:
            parts.append("embed_proj")
        return tuple(parts)

    def _relative_parts(self, config) -> dict[str, str]:
        """The encoder's shared relative-position modules: on every stage."""
        parts = {}
        if getattr(config, "relative_attention", False):
            parts["rel_embeddings"] = f"{self.base}.encoder.rel_embeddings"
            if "layer_norm" in getattr(config, "norm_rel_ebd", "none").lower():
                parts["rel_norm"] = f"{self.base}.encoder.LayerNorm"
        return parts

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        return {**super().stage_modules(model, layout, stage), **self._relative_parts(model.config)}

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        shared = []
        for key, path in self._relative_parts(model.config).items():
            names = ("weight",) if key == "rel_embeddings" else ("weight", "bias")
            shared.extend((f"{path}.{name}",) for name in names)
        return super().tied_groups(model) + shared


class DebertaSequenceClassificationRule(SequenceClassificationRule):
    """``deberta_classification_loss`` (with ``problem_type`` unset: the mean over the rows whose class index is
    ``>= 0``, regression for one label, soft targets for ``[b, n]`` labels) as this microbatch's share of the
    whole batch's mean."""

    def loss_items(self, model, labels: torch.Tensor) -> int:
        if model.config.problem_type is not None:  # the common rule
            return self.num_loss_items(labels)
        if labels.is_floating_point():  # regression or soft targets: a mean over the rows
            return labels.shape[0]
        return int((labels >= 0).sum())  # class indices: DeBERTa keeps the rows >= 0

    def classification_loss(self, logits, labels, config):
        from .modeling_deberta_v2 import deberta_classification_loss  # (modeling imports this module)

        return deberta_classification_loss(logits, labels, config)


DEBERTA_SEQUENCE_CLASSIFICATION = DebertaSequenceClassificationRule()
