"""DeBERTa-v2's masked LM as pipeline stages: BERT's encoder stages (``bert/pipeline_bert.py``: the base model's own
phases on each stage's layers, one hidden-state tensor ``[mb, s(/tp), h]`` between stages, the MLM head on the last).

What differs: the embedding parts a config has (absolute positions, token types and ``embed_proj`` are optional), and
the shared relative embeddings. Every stage's layers read ``encoder.rel_embeddings`` (and its ``LayerNorm``), so
every stage holds a copy; the copies are tied groups of the pipeline: each stage adds its layers' gradient and the
copies' gradients are summed over the stages (one all-reduce each), which keeps them equal after every step."""
from __future__ import annotations

from ..bert.pipeline_bert import MaskedLMPipelineAdapter


class DebertaV2MaskedLMPipelineAdapter(MaskedLMPipelineAdapter):

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
