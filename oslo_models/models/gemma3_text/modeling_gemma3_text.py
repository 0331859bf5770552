"""Gemma 3 (text): Gemma 2 (``models/gemma2``) with q/k norms and local/global rotary bases.

What differs from Gemma 2, and where:

- RMS norms on each query and key head (``q_norm``/``k_norm`` over ``head_dim``, the ``(1 + w)`` formula, before
  rotary): ``GroupedQueryAttention(qk_norm="gemma")``. Under tensor parallelism each rank normalizes its own heads
  and the norms' weight gradients are summed over TP (their plan style);
- two rotary embeddings: ``rope_parameters["sliding_attention"]`` (the local base, ``rope_local_base_freq`` in
  older configs) for the sliding-window layers and ``rope_parameters["full_attention"]`` (the global base, possibly
  scaled) for the others: ``Gemma3RotaryEmbedding`` is ``transformers``' module returning one ``(cos, sin)`` per
  attention type (``common/embeddings/rotary.py``'s ``PerLayerTypeRotary``), and the stack hands each layer the pair of
  its ``attention_type``;
- the sliding window pattern (``layer_types``; by default every sixth layer is global): the stack's per-type masks;
- SDPA by default (``transformers``' Gemma 3 supports it); ``attn_logit_softcapping`` (default ``None``) needs the
  eager kernel, as in ``transformers``; ``final_logit_softcapping`` when set is applied by the causal LM head.

The classes are named as ``transformers`` names the text-only model: ``Gemma3TextModel``, ``Gemma3ForCausalLM``,
``Gemma3TextForSequenceClassification``.
"""
from __future__ import annotations

import dataclasses

import transformers
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3

from ..common import PerLayerTypeRotary
from ..common.stack.stack_parts import Rotary
from ..gemma.configuration_gemma import Gemma3TextConfig
from ..gemma2 import modeling_gemma2 as gemma2


class Gemma3RotaryEmbedding(PerLayerTypeRotary, hf_gemma3.Gemma3RotaryEmbedding):
    """``forward(x, position_ids) -> {"sliding_attention": (cos, sin), "full_attention": (cos, sin)}``."""

    hf_rotary = hf_gemma3.Gemma3RotaryEmbedding


class Gemma3DecoderLayer(gemma2.Gemma2DecoderLayer):
    pass


GEMMA3_SPEC = dataclasses.replace(
    gemma2.GEMMA2_SPEC, block=Gemma3DecoderLayer, kernels=None,
    parts=(*gemma2.GEMMA2_SPEC.parts[:-1], Rotary("rotary_emb", Gemma3RotaryEmbedding)))


class Gemma3PreTrainedModel(gemma2.Gemma2PreTrainedModel):
    config_class = Gemma3TextConfig
    stack_spec = GEMMA3_SPEC

    @classmethod
    def decoder_options(cls, config):
        return dataclasses.replace(super().decoder_options(config), qk_norm="gemma")


class Gemma3TextModel(Gemma3PreTrainedModel, gemma2.Gemma2Model):
    hf_twin = transformers.Gemma3TextModel


Gemma3PreTrainedModel.base_model_class = Gemma3TextModel


class Gemma3ForCausalLM(Gemma3PreTrainedModel, gemma2.Gemma2ForCausalLM):
    hf_twin, base_model_class = transformers.Gemma3ForCausalLM, Gemma3TextModel


class Gemma3TextForSequenceClassification(Gemma3PreTrainedModel, gemma2.Gemma2ForSequenceClassification):
    hf_twin, base_model_class = transformers.Gemma3TextForSequenceClassification, Gemma3TextModel
