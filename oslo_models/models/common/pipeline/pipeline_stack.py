"""Pipeline stages of a ``TransformerStack`` model with a causal LM head, derived from its ``StackSpec``: no
per-family adapter and no second forward.

The cut is ``transformers``' ``base_model_pp_plan``: the first stage holds the token (and learned position)
embeddings, the input projection, the embedding norm and dropout, every stage holds the parameter-free rotary
embedding, the last stage holds the final norm, the output projection and ``lm_head`` (a copy of the input embedding
when they are tied); parts a config lacks are left out. A stage runs the base model's
own phases (``stack_inputs`` and ``run_stack`` with ``first``/``last`` set and its own layers), so a stage computes
exactly what the same layers compute inside ``forward``. Between stages flows the hidden states ``[mb, s, h]``
(``[mb, s/tp, h]`` under sequence parallelism; grid blocks under 2D/2.5D/3D).

Parameter counts per layer, for the partitioner, come from the layers themselves (the base model built on the
meta device with no parallelism), not from formulas.
"""
from __future__ import annotations

import torch

from ....distributed.context import ParallelContext
from ....pipeline.adapter import CausalLMPipelineAdapter
from ..loss.lm_loss import soft_cap_logits


class StackPipelineAdapter(CausalLMPipelineAdapter):
    """A causal LM over a ``TransformerStack`` base model; ``of(base_class, prefix)`` makes the subclass for one
    family (``base_class``: the base model class, ``prefix``: its attribute in the head model)."""

    base_class: type = None
    prefix: str = ""
    batch_keys = ("input_ids", "labels", "attention_mask", "position_ids", "shift_labels")
    tiled_loss_head = True  # ParallelConfig.tiled_loss: the last stage returns hidden states (run_stage)

    @classmethod
    def of(cls, base_class: type, prefix: str, **attributes) -> type:
        spec = base_class.stack_spec

        def stage_parts(*names) -> dict[str, str]:  # {attribute on the stage: module path in the model}
            return {name.rpartition(".")[2]: f"{prefix}.{name}" for name in names if name}

        first = stage_parts(spec.embed_tokens, spec.position_embedding, spec.input_projection, spec.embedding_norm,
                            spec.embedding_dropout)
        every = stage_parts(spec.rotary)
        last = {**stage_parts(spec.final_norm, spec.output_projection), "lm_head": "lm_head"}
        body = dict(base_class=base_class, prefix=prefix, layer_paths=(f"{prefix}.{spec.layers}",),
                    first_modules=first, every_stage_modules=every, last_modules=last,
                    tied_embedding=f"{prefix}.{spec.embed_tokens}.weight", **attributes)
        return type(f"{base_class.__name__}PipelineAdapter", (cls,), body)

    def absent_modules(self, model) -> frozenset[str]:
        """Stage module paths this config lacks (OPT's ``project_in`` when the widths agree, its final norm under
        post-norm): the base model's ``absent_parts``, fixed when it was built (not what ``model`` lacks now: its
        stages may already have dropped what they do not run)."""
        absent = getattr(model, self.prefix).absent_parts
        paths = {**self.first_modules, **self.every_stage_modules, **self.last_modules}.values()
        return frozenset(path for path in paths
                         if path.startswith(f"{self.prefix}.") and path[len(self.prefix) + 1:] in absent)

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        absent = self.absent_modules(model)
        return {name: path for name, path in super().stage_modules(model, layout, stage).items()
                if path not in absent}

    def optional_modules(self, model, layout) -> set[str]:
        return super().optional_modules(model, layout) - self.absent_modules(model)

    def layer_counts(self, model) -> tuple[int, ...]:
        return (model.config.num_hidden_layers,)

    def _plain_base(self, config):
        with torch.device("meta"):
            return self.base_class(config, parallel_context=ParallelContext.single_process(), submodule=True)

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Each layer's parameters, the first stage's extra (embeddings) and the last stage's (final norm and the
        head, a full ``vocab x h`` even when tied: the last stage holds a copy), counted on the meta-built model."""
        base = self._plain_base(model.config)
        spec = base.stack_spec

        def count(module) -> float:
            return float(sum(p.numel() for p in module.parameters())) if module is not None else 0.0

        costs = [count(layer) for layer in base.part(spec.layers)]
        first = sum(count(base.part(path[len(self.prefix) + 1:])) for path in self.first_modules.values())
        embed = base.part(spec.embed_tokens).weight
        last = sum(count(base.part(name)) for name in (spec.final_norm, spec.output_projection))
        return costs, first, last + float(embed.numel())

    def use_sequence_parallel(self, model, batch) -> bool:
        from ..stack.sequence_parallel import use_sequence_parallel

        return use_sequence_parallel(getattr(model, self.prefix), batch["input_ids"].shape[-1])

    def stage_forward(self, stage, x, attention_mask=None, position_ids=None):
        return self.run_stage(stage, x, attention_mask, position_ids)

    def run_stage(self, stage, x, attention_mask=None, position_ids=None, **layer_kwargs):
        """The stage's computation; ``layer_kwargs`` go to every layer (the MoE adapter's router-logit collector).
        First stage: ``x`` is ``input_ids [mb, s]``; last stage returns the local logits ``[mb, s, V_padded/tp]``
        (the loss runs on the split vocabulary; no gather), or its final hidden states ``[mb, s, h]`` under the
        tiled loss (``tiles_loss``: the loss runs the head in row chunks)."""
        hidden = run_stage_stack(getattr(stage.owner, self.prefix), stage, x, attention_mask, position_ids,
                                 **layer_kwargs)
        if not stage.is_last or self.tiles_loss(stage.owner):
            return hidden
        return soft_cap_logits(stage.lm_head(hidden), stage.owner.final_logit_softcap())  # Gemma 2/3's cap


def run_stage_stack(base, stage, x, attention_mask=None, position_ids=None, **run_kwargs):
    """The base model's own phases (``stack_inputs``, ``run_stack``) on the stage's layers: ``x`` is ``input_ids
    [mb, s]`` on the first stage, hidden states ``[mb, s(/tp), h]`` elsewhere; returns hidden states (``[mb, s, h]``
    on the last stage). ``run_kwargs`` go to ``run_stack`` (layer kwargs; an encoder's ``token_type_ids``)."""
    context, sp = stage.parallel_context, stage.sequence_parallel
    seq_len = x.shape[-1] if stage.is_first else x.shape[1] * (context.tp_size if sp else 1)
    # Masks and rotary read only the batch size, length, dtype and device: a zero-size expanded view stands in
    # for the full [mb, s, h] activations that only the first stage ever has.
    dtype = next(stage.parameters()).dtype if not x.is_floating_point() else x.dtype
    shape_like = torch.zeros((), dtype=dtype, device=x.device).expand(x.shape[0], seq_len,
                                                                      stage.model_config.hidden_size)
    inputs = base.stack_inputs(shape_like, attention_mask, position_ids, None, layers=stage.layers,
                               sequence_parallel=sp)
    return base.run_stack(x, inputs, layers=stage.layers, first=stage.is_first, last=stage.is_last, **run_kwargs)
