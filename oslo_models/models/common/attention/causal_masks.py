"""Per-layer attention masks of decoder stacks whose layers are full or sliding-window causal.

The layer kinds follow ``transformers``: ``config.layer_types`` when the config has it (Qwen2/Qwen3 derive it from
``use_sliding_window`` and ``max_window_layers``; newer configs store it), otherwise every layer is
``"sliding_attention"`` when ``config.sliding_window`` is set (Mistral) and ``"full_attention"`` else (Llama).
The masks are built by ``transformers``' own ``create_causal_mask`` / ``create_sliding_window_causal_mask``, for
the full sequence: attention runs on full sequences of this rank's heads even under sequence parallelism.

Packed documents (``utils/documents.py``: ``position_ids`` that restart, padding as one-token documents) attend
within themselves in every core. On the FlexAttention core (:func:`uses_flex`) every layer gets one
``DocumentMask`` (``parallel_layers/document_attention.py``: block masks, no ``[s, s]`` tensor); on SDPA and eager
``transformers`` builds the dense per-document mask from positions restarting per document, with no cache and no
padding mask in the way (it reads packing only then: an eval forward makes an empty cache, a packed row may end in
padding).
"""
from __future__ import annotations

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ....parallel_layers.document_attention import DocumentMask, flex_trains
from ....utils.documents import document_ids, positions_in_documents
from .cache_names import MASK_CACHE_KEYWORD

FULL, SLIDING = "full_attention", "sliding_attention"


def layer_types(config) -> list[str]:
    """``"full_attention"`` or ``"sliding_attention"`` for each of the ``num_hidden_layers`` layers."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    return [SLIDING if getattr(config, "sliding_window", None) else FULL] * config.num_hidden_layers


def every_layer_slides(config) -> list[str]:
    """One kind for all ``num_hidden_layers`` layers, ``layer_types`` ignored (Mistral, Phi-3, Starcoder2: the model
    picks one mask for all layers): ``"sliding_attention"`` when ``sliding_window`` is not ``None``."""
    return [SLIDING if config.sliding_window is not None else FULL] * config.num_hidden_layers


def uses_flex(config, device: torch.device) -> bool:
    """Whether packed documents run on the FlexAttention core: asked for (``attn_implementation=
    "flex_attention"``), or the default SDPA on a device where Flex trains (CUDA) with no attention dropout
    (Flex has none). CPU keeps SDPA with the dense mask: torch has no Flex backward there."""
    implementation = config._attn_implementation
    if implementation == "flex_attention":
        return True
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    return implementation == "sdpa" and not dropout and flex_trains(device)


def packed_documents(inputs_embeds: torch.Tensor, attention_mask, past_key_values, position_ids):
    """``[b, s]`` document ids of a packed batch, or ``None`` (not packed, or decoding after a cached prefix)."""
    if past_key_values is not None and past_key_values.get_seq_length() > 0:
        return None
    if attention_mask is not None and attention_mask.dim() != 2:
        return None  # a prepared 4D mask decides
    batch, seq = inputs_embeds.shape[:2]
    return document_ids(batch, seq, position_ids=position_ids, attention_mask=attention_mask,
                        device=inputs_embeds.device)


def causal_masks(config, inputs_embeds: torch.Tensor, attention_mask, past_key_values, position_ids, *,
                 kinds=None) -> dict:
    """``{layer type: mask}`` for ``kinds`` (default: every kind the config uses; a pipeline stage passes its own
    layers' kinds), each as the attention kernel takes it (or ``None`` where the kernel can run causally without
    one; a ``DocumentMask`` for packed documents on Flex). ``inputs_embeds`` is read only for its batch size,
    length, dtype and device. An ``attention_mask`` that already is such a dict (prepared by ``generate``) is
    returned as is."""
    if isinstance(attention_mask, dict):
        return attention_mask
    kinds = set(layer_types(config) if kinds is None else kinds)
    documents = packed_documents(inputs_embeds, attention_mask, past_key_values, position_ids)
    if documents is not None:
        if uses_flex(config, inputs_embeds.device):  # each layer passes its own sliding window
            mask = DocumentMask(documents)
            return {kind: mask for kind in kinds}
        attention_mask, past_key_values, position_ids = None, None, positions_in_documents(documents)
    kwargs = {"config": config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
              MASK_CACHE_KEYWORD: past_key_values, "position_ids": position_ids}
    masks = {}
    if FULL in kinds:
        masks[FULL] = create_causal_mask(**kwargs)
    if SLIDING in kinds:
        masks[SLIDING] = create_sliding_window_causal_mask(**kwargs)
    return masks
