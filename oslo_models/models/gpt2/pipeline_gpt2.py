"""GPT-2 LM as pipeline stages (see ``oslo_models/pipeline/adapter.py`` for the vocabulary).

First stage: ``wte`` + ``wpe`` + ``drop``; layers ``transformer.h``; last stage: ``ln_f`` + ``lm_head`` (tied to
``wte``). Between stages flows one tensor, the hidden states ``[mb, s, h]`` (``[mb, s/tp, h]`` under sequence
parallelism, each TP rank sending its own slice to the same TP rank of the next stage).
"""
from __future__ import annotations

import torch
from transformers.masking_utils import create_causal_mask

from ...parallel_layers.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from ...pipeline.adapter import CausalLMPipelineAdapter

FIRST = {"wte": "transformer.wte", "wpe": "transformer.wpe", "drop": "transformer.drop"}
LAST = {"ln_f": "transformer.ln_f", "lm_head": "lm_head"}


class GPT2LMPipelineAdapter(CausalLMPipelineAdapter):
    """Stage forward: first stage ``input_ids [mb, s]`` -> embeddings (vocab-parallel all-reduce over TP) -> SP
    scatter -> dropout; every stage its blocks; last stage ``ln_f`` -> SP all-gather -> ``lm_head`` -> local
    logits ``[mb, s, V_padded/tp]`` (the loss runs on the split vocabulary; no logits gather)."""

    layer_paths = ("transformer.h",)
    batch_keys = ("input_ids", "labels", "attention_mask", "position_ids")
    first_modules, last_modules, tied_embedding = FIRST, LAST, "transformer.wte.weight"
    grid_modes = True

    def layer_counts(self, model) -> tuple[int, ...]:
        return (model.config.num_hidden_layers,)

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        config = model.config
        h, inner = config.hidden_size, config.n_inner or 4 * config.hidden_size
        layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
        embeddings = config.vocab_size * h + config.max_position_embeddings * h
        return [float(layer)] * config.num_hidden_layers, float(embeddings), float(config.vocab_size * h + 2 * h)

    def use_sequence_parallel(self, model, batch) -> bool:
        return model.transformer._use_sequence_parallel(batch["input_ids"].shape[-1])

    def stage_forward(self, stage, x, attention_mask=None, position_ids=None):
        config, context, sp = stage.model_config, stage.parallel_context, stage.sequence_parallel
        if stage.is_first:
            seq_len = x.shape[-1]
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=x.device).unsqueeze(0)
            hidden = stage.wte(x) + stage.wpe(position_ids)
            if sp:
                hidden = scatter_to_sequence_parallel_region(hidden, context.tp_group)
            hidden = stage.drop(hidden, sequence_parallel=sp)
        else:
            hidden = x
            seq_len = hidden.shape[1] * (context.tp_size if sp else 1)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
        # The mask only reads the batch size, sequence length, dtype and device of inputs_embeds: a zero-size
        # expanded view stands in for the full [mb, s, h] activations that only the first stage ever has.
        shape_only = hidden.new_zeros(()).expand(hidden.shape[0], seq_len, hidden.shape[-1])
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(hidden.shape[0], -1)
        mask = create_causal_mask(config=config, inputs_embeds=shape_only, attention_mask=attention_mask,
                                  past_key_values=None, position_ids=position_ids)
        for block in stage.layers:
            hidden = block(hidden, mask, None, sequence_parallel=sp, position_ids=position_ids)
        if not stage.is_last:
            return hidden
        hidden = stage.ln_f(hidden, sequence_parallel=sp)
        if sp:
            hidden = gather_from_sequence_parallel_region(hidden, context.tp_group, grad_is_partial=False)
        return stage.lm_head(hidden)  # [mb, s, V_padded/tp]
