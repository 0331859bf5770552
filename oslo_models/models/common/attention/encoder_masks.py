"""Bidirectional masks of the encoder families (BERT, RoBERTa, ALBERT, ELECTRA, DistilBERT, DeBERTa-v2, ModernBERT)
for packed documents: every token attends to every token of its own document, and to nothing else.

A packed batch (``utils/documents.py``: ``position_ids`` restarting per document; ``cu_seqlens`` / ``seq_idx``,
which the base model's ``forward`` turns into such positions first: ``TransformerStack._packed_positions``) gives
each token a document id ``documents [b, s]``; every padding token is a document of its own (it attends to itself
only and nothing attends to it). What each core receives:

- FlexAttention (``attn_implementation="flex_attention"``, or the default SDPA where Flex trains: CUDA; the rule is
  the decoders' ``causal_masks.uses_flex``): one ``DocumentMask(documents, causal=False)`` for every layer, whose
  block mask is built from per-block document ranges (no ``[s, s]`` tensor; a bidirectional sliding window is
  ``|q - k| < window``, the kernel's window the layer passes);
- SDPA / eager: ``transformers``' own bidirectional (or bidirectional sliding-window) mask in the core's format,
  intersected with ``same document`` (``transformers``' ``packed_sequence_mask_function``);
- flash attention: refused (its padding-mask path has no per-document form; varlen is not wired for encoders).

Within a document the relative distance of two tokens equals their distance in the document run alone, so rotary
(ModernBERT), DeBERTa's relative buckets and bidirectional sliding windows give exactly the one-document-per-row
values; learned absolute positions read the restarting ``position_ids``.

Shapes: ``shape_like [b, s, ...]`` (batch, length, dtype and device read), ``position_ids [b, s]``,
``attention_mask [b, s]`` 0/1.
"""
from __future__ import annotations

import torch
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    packed_sequence_mask_function,
)

from ....parallel_layers.document_attention import DocumentMask
from ....utils.documents import document_ids
from .causal_masks import FULL, SLIDING, uses_flex

PACKED_HEAD_REFUSAL = ("{name} reads one output per row ({what}); a packed batch (position_ids restarting per "
                       "document, cu_seqlens or seq_idx) holds several documents per row, so that output would mix "
                       "or drop documents: run such a head on one sequence per row (masked-LM and token-"
                       "classification heads take packed batches)")


def encoder_documents(shape_like: torch.Tensor, attention_mask, position_ids) -> torch.Tensor | None:
    """``[b, s]`` document ids of a packed encoder batch, or ``None`` (no caller-given ``position_ids``, a prepared
    4D mask, or one document per row: left and right padding are not packing)."""
    if position_ids is None or isinstance(attention_mask, dict):
        return None
    if attention_mask is not None and attention_mask.dim() != 2:
        return None  # a prepared mask decides
    batch, seq = shape_like.shape[:2]
    return document_ids(batch, seq, position_ids=position_ids, attention_mask=attention_mask,
                        device=shape_like.device)


def refuse_flash(config, what: str) -> None:
    if "flash" in (config._attn_implementation or ""):
        raise NotImplementedError(f"{what}: packed documents under attn_implementation="
                                  f"{config._attn_implementation!r} are not implemented for the encoders (the "
                                  "varlen kernel is not wired); use 'sdpa', 'eager' or 'flex_attention'")


def document_bidirectional_masks(config, shape_like: torch.Tensor, documents: torch.Tensor, kinds) -> dict:
    """``{kind: mask}`` for ``kinds`` (``"full_attention"``: bidirectional; ``"sliding_attention"``: bidirectional
    within ``config.sliding_window``), every mask also ``same document``; see the module docstring."""
    refuse_flash(config, type(config).__name__.replace("Config", ""))
    if uses_flex(config, shape_like.device):
        mask = DocumentMask(documents, causal=False)  # each layer passes its own window
        return {kind: mask for kind in kinds}
    options = dict(config=config, inputs_embeds=shape_like, attention_mask=None,
                   and_mask_function=packed_sequence_mask_function(documents))
    build = {FULL: create_bidirectional_mask, SLIDING: create_bidirectional_sliding_window_mask}
    return {kind: build[kind](**options) for kind in kinds}


def same_document(documents: torch.Tensor) -> torch.Tensor:
    """bool ``[b, 1, s, s]``: query and key in one document (the dense form, for masks a family builds itself)."""
    return (documents[:, :, None] == documents[:, None, :])[:, None]


def is_packed_batch(input_ids, inputs_embeds, attention_mask, position_ids, packing: dict) -> bool:
    """Whether a head's batch is packed: ``packing`` holds the batch's ``cu_seqlens`` / ``seq_idx`` keys (any
    value), or the caller's ``position_ids`` restart inside a row's real tokens."""
    if any(value is not None for value in packing.values()):
        return True
    like = input_ids if input_ids is not None else inputs_embeds
    if position_ids is None or like is None:
        return False
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    return document_ids(like.shape[0], like.shape[1], position_ids=position_ids, attention_mask=mask,
                        device=like.device) is not None
