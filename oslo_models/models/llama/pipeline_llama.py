"""Llama-shaped causal LMs (Llama, Mistral, Qwen2, Qwen3) as pipeline stages (see ``oslo_models/pipeline/adapter.py``).

The cut is ``transformers``' ``base_model_pp_plan``: first stage ``model.embed_tokens``; layers ``model.layers``;
last stage ``model.norm`` + ``lm_head`` (a copy of ``embed_tokens`` when the embeddings are tied). Every stage holds
the parameter-free ``model.rotary_emb`` and builds ``cos``/``sin`` and the per-layer-type masks (full and sliding
window) for the full sequence from ``position_ids``/``attention_mask``, as ``LlamaModel.forward`` does. Between
stages flows one tensor, the hidden states ``[mb, s, h]`` (``[mb, s/tp, h]`` under sequence parallelism, each TP
rank sending its own slice to the same TP rank of the next stage).
"""
from __future__ import annotations

import torch

from ...pipeline.adapter import CausalLMPipelineAdapter
from ..common import causal_masks, enter_sequence_parallel, leave_sequence_parallel, use_sequence_parallel

FIRST = {"embed_tokens": "model.embed_tokens"}
EVERY = {"rotary_emb": "model.rotary_emb"}
LAST = {"norm": "model.norm", "lm_head": "lm_head"}


class LlamaPipelineAdapter(CausalLMPipelineAdapter):
    """Stage forward: first stage ``input_ids [mb, s]`` -> embeddings (vocab-parallel all-reduce over TP) -> SP
    scatter; every stage its layers; last stage ``norm`` -> SP all-gather -> ``lm_head`` -> local logits
    ``[mb, s, V_padded/tp]`` (the loss runs on the split vocabulary; no logits gather)."""

    layer_paths = ("model.layers",)
    batch_keys = ("input_ids", "labels", "attention_mask", "position_ids")
    first_modules, last_modules, tied_embedding = FIRST, LAST, "model.embed_tokens.weight"
    every_stage_modules = EVERY

    def layer_counts(self, model) -> tuple[int, ...]:
        return (model.config.num_hidden_layers,)

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        config = model.config
        h, inter = config.hidden_size, config.intermediate_size
        d = getattr(config, "head_dim", None) or h // config.num_attention_heads
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        layer = 2 * h + h * (q + 2 * kv) + q * h + 3 * h * inter
        embeddings = config.vocab_size * h
        return [float(layer)] * config.num_hidden_layers, float(embeddings), float(embeddings + h)

    def use_sequence_parallel(self, model, batch) -> bool:
        return use_sequence_parallel(model.model, batch["input_ids"].shape[-1])

    def stage_forward(self, stage, x, attention_mask=None, position_ids=None):
        return self.run_stage(stage, x, attention_mask, position_ids)

    def run_stage(self, stage, x, attention_mask=None, position_ids=None, **layer_kwargs):
        """The stage's computation; ``layer_kwargs`` go to every layer (the MoE adapter's router-logit collector)."""
        config, context, sp = stage.model_config, stage.parallel_context, stage.sequence_parallel
        if stage.is_first:
            hidden = stage.embed_tokens(x)
            seq_len = x.shape[-1]
            if sp:
                hidden = enter_sequence_parallel(hidden, context)
        else:
            hidden = x
            seq_len = hidden.shape[1] * (context.tp_size if sp else 1)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=hidden.device)[None]
        # Masks and rotary read only the batch size, length, dtype and device of the embeddings: a zero-size
        # expanded view stands in for the full [mb, s, h] activations that only the first stage ever has.
        shape_only = hidden.new_zeros(()).expand(hidden.shape[0], seq_len, hidden.shape[-1])
        masks = causal_masks(config, shape_only, attention_mask, None, position_ids,
                             kinds={layer.attention_type for layer in stage.layers})
        position_embeddings = stage.rotary_emb(shape_only, position_ids)
        for layer in stage.layers:
            hidden = layer(hidden, masks[layer.attention_type], position_embeddings, None, sequence_parallel=sp,
                           position_ids=position_ids, **layer_kwargs)
        if not stage.is_last:
            return hidden
        hidden = stage.norm(hidden, sequence_parallel=sp)
        if sp:
            hidden = leave_sequence_parallel(hidden, context)
        return stage.lm_head(hidden)  # [mb, s, V_padded/tp]
