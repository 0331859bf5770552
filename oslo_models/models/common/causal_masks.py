"""Per-layer attention masks of decoder stacks whose layers are full or sliding-window causal.

The layer kinds follow ``transformers``: ``config.layer_types`` when the config has it (Qwen2/Qwen3 derive it from
``use_sliding_window`` and ``max_window_layers``; newer configs store it), otherwise every layer is
``"sliding_attention"`` when ``config.sliding_window`` is set (Mistral) and ``"full_attention"`` else (Llama).
The masks are built by ``transformers``' own ``create_causal_mask`` / ``create_sliding_window_causal_mask``, for
the full sequence: attention runs on full sequences of this rank's heads even under sequence parallelism.
"""
from __future__ import annotations

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

FULL, SLIDING = "full_attention", "sliding_attention"


def layer_types(config) -> list[str]:
    """``"full_attention"`` or ``"sliding_attention"`` for each of the ``num_hidden_layers`` layers."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    return [SLIDING if getattr(config, "sliding_window", None) else FULL] * config.num_hidden_layers


def causal_masks(config, inputs_embeds: torch.Tensor, attention_mask, past_key_values, position_ids, *,
                 kinds=None) -> dict:
    """``{layer type: mask}`` for ``kinds`` (default: every kind the config uses; a pipeline stage passes its own
    layers' kinds), each as the attention kernel takes it (or ``None`` where the kernel can run causally without
    one). ``inputs_embeds`` is read only for its batch size, length, dtype and device. An ``attention_mask`` that
    already is such a dict (prepared by ``generate``) is returned as is."""
    if isinstance(attention_mask, dict):
        return attention_mask
    kwargs = dict(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                  past_key_values=past_key_values, position_ids=position_ids)
    kinds = set(layer_types(config) if kinds is None else kinds)
    masks = {}
    if FULL in kinds:
        masks[FULL] = create_causal_mask(**kwargs)
    if SLIDING in kinds:
        masks[SLIDING] = create_sliding_window_causal_mask(**kwargs)
    return masks
