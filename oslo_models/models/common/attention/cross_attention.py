"""Keys and values of an attention layer that may sit in an encoder-decoder decoder: written once for every family
whose decoder layers attend to an encoder's output (BART's ``encoder_attn``, BERT's ``crossattention`` as the
decoder of ``EncoderDecoderModel``; T5 keeps its own older copy of the same rule in ``t5/layers_t5.py``).

``transformers``' rule, which ``generate`` relies on: with an ``EncoderDecoderCache`` the self-attention appends
this step's keys/values to ``self_attention_cache``; the cross-attention projects the encoder output once (the
first step), stores it in ``cross_attention_cache`` and marks the layer ``is_updated``, and every later step reads it
back without projecting again. A plain ``DynamicCache`` (a decoder without cross-attention) is the self-attention
cache itself.

Under tensor parallelism every tensor here holds this rank's heads only (``[b, n/tp, s, d]``): the cache is
per rank, like the projections that fill it. The encoder output is full and replicated over TP (never split by
sequence), so the cross-attention's k/v projections are called with ``sequence_parallel=False``: no all-gather
forward; their backward all-reduce over TP (the column-parallel input mapping) sums the encoder-output gradient.
No collective of its own.
"""
from __future__ import annotations

from typing import Callable

import torch
from transformers.cache_utils import EncoderDecoderCache


def self_attention_cache(past_key_values):
    """The cache the self-attention and the causal mask read: the self part of an ``EncoderDecoderCache``."""
    if isinstance(past_key_values, EncoderDecoderCache):
        return past_key_values.self_attention_cache
    return past_key_values


def cached_keys_values(past_key_values, layer_idx: int, *, cross: bool,
                       project: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
    """``(key, value)`` ``[b, n/tp, s_k, d]`` of layer ``layer_idx``: ``project()`` (this step's, or the encoder
    output's for ``cross``), appended to / stored in the cache when there is one; a cross-attention whose encoder
    keys are cached already reads them back and does not project."""
    if past_key_values is None:
        return project()
    if cross:
        if not isinstance(past_key_values, EncoderDecoderCache):
            raise ValueError("cross-attention with a cache needs an EncoderDecoderCache (self- and cross-attention "
                             f"parts), got {type(past_key_values).__name__}")
        cache = past_key_values.cross_attention_cache
        if past_key_values.is_updated.get(layer_idx):  # the encoder keys of step one
            return cache.layers[layer_idx].keys, cache.layers[layer_idx].values
        key, value = cache.update(*project(), layer_idx)
        past_key_values.is_updated[layer_idx] = True
        return key, value
    return self_attention_cache(past_key_values).update(*project(), layer_idx)
