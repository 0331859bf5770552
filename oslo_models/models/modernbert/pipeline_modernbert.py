"""ModernBERT's heads as pipeline stages: the encoder stages every encoder head shares
(``common/pipeline/pipeline_encoder.py``: the base model's own phases on each stage's layers, one hidden-state tensor
``[mb, s(/tp), h]`` between stages, the head class's task rule on the last) with ModernBERT's parts. The first stage
holds the embeddings (``tok_embeddings``, ``norm``, ``drop``), every stage the parameter-free ``rotary_emb`` (both
bases), the last stage the ``final_norm`` and the head. Masked LM: the ``head`` and the vocab-parallel ``decoder`` (a
copy of the token embeddings when tied: the tied group keeps both copies equal, their gradients summed over the two
stages). The other heads run the head class's own rule (``head``, ``drop``, ``classifier`` after the
``classifier_pooling`` pooling, which reads the ``attention_mask`` every stage receives)."""
from __future__ import annotations


class ModernBertStages:
    """``pipeline_stages`` of every ModernBERT head (mixed in before ``EncoderPipelineAdapter``): its embedding parts,
    the rotary embedding on every stage, the final norm on the last, no token types."""

    word_embeddings = "embeddings.tok_embeddings"
    unused_batch_keys = ("token_type_ids",)

    def _embedding_parts(self, model) -> tuple[str, ...]:
        return ("tok_embeddings", "norm", "drop")

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        modules = {**super().stage_modules(model, layout, stage), "rotary_emb": f"{self.base}.rotary_emb"}
        if stage == layout.num_stages - 1:
            modules["final_norm"] = f"{self.base}.final_norm"
        return modules

    def optional_modules(self, model, layout) -> set[str]:
        return super().optional_modules(model, layout) | {f"{self.base}.final_norm"}

    def stage_forward(self, stage, x, attention_mask=None, token_type_ids=None, position_ids=None):
        return super().stage_forward(stage, x, attention_mask, None, position_ids)  # no token types
