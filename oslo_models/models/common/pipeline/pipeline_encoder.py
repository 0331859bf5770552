"""Pipeline stages of every encoder head (BERT, RoBERTa, DistilBERT, ELECTRA, ALBERT, DeBERTa-v2, ModernBERT): one
adapter, bound to the head class (``of(model_class)``), whose last stage runs the head class's task rule
(``head_rule``: ``common/loss/head_rules.py``, the rule its own ``forward`` runs).

A stage runs the base model's own phases (``stack_inputs``, ``run_stack``: ``pipeline_stack.run_stage_stack``) on its
layers, exactly what the base model's ``forward`` runs: the first stage the embeddings and the sequence-parallel
scatter, every stage the bidirectional mask and its layers, the last the gather back and the head. Between stages
flows the hidden states ``[mb, s, h]`` (``[mb, s/tp, h]`` under sequence parallelism, each TP rank sending its own
slice to the same TP rank of the next stage). Off the first stage the embedding *parts* are dropped (the empty
``embeddings`` container stays, so ``get_input_embeddings()`` reads ``None``); off the last stage the outermost head
modules are. Parameter counts per layer come from the head class built on the meta device, not from formulas.

What a family's module tree adds (ALBERT's depth over shared layer groups, DeBERTa's relative embeddings on every
stage, ModernBERT's rotary embedding and final norm) is a mixin the family's classes name as ``pipeline_stages``
(in its ``pipeline_<family>.py``), put before this class.
"""
from __future__ import annotations

import torch

from ....distributed.context import ParallelContext
from ....pipeline.adapter import PipelineAdapter
from ..loss.head_rules import RuleLoss
from ..stack.sequence_parallel import use_sequence_parallel
from .pipeline_stack import run_stage_stack

EMBEDDING_PARTS = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm", "dropout")


class EncoderPipelineAdapter(RuleLoss, PipelineAdapter):
    model_class: type = None  # the head model class (``of``)
    rule = None  # its ``head_rule``
    base = "bert"  # the encoder's ``base_model_prefix``
    batch_keys = ("input_ids", "labels", "attention_mask", "token_type_ids", "position_ids")
    head_modules: dict[str, str] = {}
    #: the input embedding, under the base model (tied to a masked LM's decoder)
    word_embeddings = "embeddings.word_embeddings"

    @classmethod
    def of(cls, model_class: type) -> type:
        stages, rule = getattr(model_class, "pipeline_stages", None), model_class.head_rule
        bases = (stages, cls) if stages is not None else (cls,)
        keys = tuple(key for key in cls.batch_keys if key not in getattr(stages, "unused_batch_keys", ()))
        base = model_class.base_model_prefix
        body = dict(model_class=model_class, rule=rule, base=base, head_modules=rule.modules(model_class),
                    layer_paths=(f"{base}.{model_class.stack_spec.layers}",), input_ids_dims=rule.input_ids_dims,
                    batch_keys=keys + rule.extra_batch_keys)
        return type(f"{model_class.__name__}PipelineAdapter", bases, body)

    # ------------------------------------------------------------------ structure
    def layer_counts(self, model) -> tuple[int, ...]:
        return (model.config.num_hidden_layers,)

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Each layer's parameters, the embeddings' (first stage) and the head's (last stage; a tied decoder counts
        its full ``vocab x h``: the last stage holds a copy), counted on the head class built on the meta device."""
        with torch.device("meta"):
            plain = self.model_class(model.config, parallel_context=ParallelContext.single_process())

        def count(*modules) -> float:
            return float(sum({id(p): p.numel() for m in modules for p in m.parameters()}.values()))

        base = getattr(plain, self.base)
        costs = [count(layer) for layer in plain.get_submodule(self.layer_paths[0])]
        head = [plain.get_submodule(path) for path in self._outermost(set(self.head_modules.values()))]
        extras = [base.get_submodule(path) for path in self._embedding_extras(model)]
        return costs, count(base.embeddings, *extras), count(*head)

    def _embedding_extras(self, model) -> tuple[str, ...]:
        """Modules of the base model the embedding phase runs besides ``embeddings`` (ELECTRA's
        ``embeddings_project``), relative to the base model; none for a base model without the hook."""
        extras = getattr(self.model_class.base_model_class, "embedding_extras", None)
        return extras(model.config) if extras is not None else ()

    def _embedding_parts(self, model) -> tuple[str, ...]:
        embeddings = model.get_submodule(f"{self.base}.embeddings")  # DistilBERT's have no token types
        return tuple(part for part in EMBEDDING_PARTS if hasattr(embeddings, part))

    def _embedding_modules(self, model) -> dict[str, str]:
        # The container runs the forward; its parts are listed so that they are kept here and dropped elsewhere.
        path = f"{self.base}.embeddings"
        return {"embeddings": path, **{f"embeddings_{part}": f"{path}.{part}" for part in self._embedding_parts(model)},
                **{f"embeddings_extra_{i}": f"{self.base}.{extra}"
                   for i, extra in enumerate(self._embedding_extras(model))}}

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        modules = self._embedding_modules(model) if stage == 0 else {}
        if stage == layout.num_stages - 1:
            modules.update(self.head_modules)
        return modules

    @staticmethod
    def _outermost(paths: set[str]) -> set[str]:
        return {path for path in paths if not any(path.startswith(outer + ".") for outer in paths)}

    def optional_modules(self, model, layout) -> set[str]:
        """The embedding parts and the outermost head modules (a module inside a dropped one goes with it)."""
        parts = set(self._embedding_modules(model).values()) - {f"{self.base}.embeddings"}
        return self._outermost(parts | set(self.head_modules.values()))

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        return self.rule.tied_groups(model, f"{self.base}.{self.word_embeddings}.weight")

    # ------------------------------------------------------------------ batches, shapes and the loss (the rule's)
    def prepare_batch(self, model, batch):
        return self.rule.prepare_batch(model, batch)

    def use_sequence_parallel(self, model, batch) -> bool:
        return use_sequence_parallel(model, batch["input_ids"].shape[-1])

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        mb, seq_len = microbatch["input_ids"].shape
        return self.hidden_state_io(model, layout, stage, microbatch, sequence_parallel,
                                    lambda: self.rule.output_shape(model, mb, seq_len))

    # ------------------------------------------------------------------ compute
    def stage_forward(self, stage, x, attention_mask=None, token_type_ids=None, position_ids=None):
        # token_type_ids / position_ids reach every stage; only the first stage's embeddings read them
        hidden = run_stage_stack(getattr(stage.owner, self.base), stage, x, attention_mask, position_ids,
                                 token_type_ids=token_type_ids)
        if not stage.is_last:
            return hidden
        return self.rule.logits(self.model_class, stage, hidden, attention_mask, stage.model_config)
