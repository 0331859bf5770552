"""Phi-3: the Llama decoder (``models/llama``) with Phi-3's own pieces, each a shared component:

- one fused ``qkv_proj`` packing q|k|v of unequal sizes under grouped-query attention (``PackedQKVAttention``;
  tensor-parallel as ``PackedKVHeadColwise``: this rank's query heads and the key/value heads they read, from each
  block, key/value heads replicated when ``tp > num_key_value_heads``);
- one fused ``gate_up_proj`` (``PackedGatedMLP``: ``down(up * act(gate))``, gate|up split per block under TP);
- partial rotary (``partial_rotary_factor``) and every ``rope_parameters`` type ``transformers`` gives Phi-3
  (``longrope`` with ``short_factor``/``long_factor`` switching past ``original_max_position_embeddings``):
  ``PartialRotaryEmbedding``, ``transformers``' own rotary module;
- residual dropouts ``resid_attn_dropout`` / ``resid_mlp_dropout`` (``resid_pdrop``) on each branch before the add
  (``ResidualDropout`` roles of the pre-norm block). ``embd_pdrop`` is read by no module, as in ``transformers``;
- sliding-window attention in every layer when ``sliding_window`` is set (``transformers``' Phi-3 rule);
- ``generate``: past ``original_max_position_embeddings`` the cache built with the short factors is dropped once
  and the sequence recomputed with the long ones, exactly as ``transformers``' ``Phi3ForCausalLM`` does.

Shapes: b batch, s sequence, h hidden, n query heads, n_kv key/value heads, d head dim.
"""
from __future__ import annotations

import transformers
from torch import nn

from ..common import PackedGatedMLP, PackedQKVAttention, PartialRotaryEmbedding, RMSNorm
from ..common.attention.causal_masks import SLIDING, every_layer_slides
from ..common.stack.blocks import PreNormBlock, ResidualDropout
from ..common.stack.stack import StackSpec
from ..common.stack.stack_parts import Rotary
from ..llama import modeling_llama as llama
from .configuration_phi3 import Phi3Config


class Phi3DecoderLayer(PreNormBlock):
    """``x + resid_attn_dropout(self_attn(input_layernorm(x)))``, then ``x + resid_mlp_dropout(mlp(
    post_attention_layernorm(x)))``; registered in ``transformers``' order."""

    names = dict(attn_norm="input_layernorm", attn="self_attn", mlp_norm="post_attention_layernorm", mlp="mlp",
                 attn_dropout="resid_attn_dropout", mlp_dropout="resid_mlp_dropout")

    def __init__(self, config, layer_idx: int, *, options: dict, attention_type: str, mlp: nn.Module):
        window = config.sliding_window if attention_type == SLIDING else None
        attention = PackedQKVAttention(config, layer_idx, sliding_window=window)

        def norm():
            return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, formula="llama")

        super().__init__(attn=attention, mlp=mlp, attn_norm=norm(), mlp_norm=norm(),
                         attn_dropout=ResidualDropout(config.resid_pdrop),
                         mlp_dropout=ResidualDropout(config.resid_pdrop),
                         order=("attn", "mlp", "attn_norm", "mlp_norm", "attn_dropout", "mlp_dropout"))
        self.attention_type = attention_type


PHI3_SPEC = StackSpec(block=Phi3DecoderLayer,
                      components=dict(attn=PackedQKVAttention, mlp=PackedGatedMLP, attn_norm=RMSNorm,
                                      mlp_norm=RMSNorm, attn_dropout=ResidualDropout, mlp_dropout=ResidualDropout),
                      parts=(*llama.DECODER_PARTS[:-1], Rotary("rotary_emb", PartialRotaryEmbedding)))


class Phi3PreTrainedModel(llama.LlamaPreTrainedModel):
    config_class = Phi3Config
    config: Phi3Config
    stack_spec = PHI3_SPEC

    @classmethod
    def decoder_options(cls, config) -> llama.DecoderOptions:
        return cls.switches()

    #: every layer slides when ``sliding_window`` is set (``Phi3Model`` picks one mask for all layers)
    attention_types = staticmethod(every_layer_slides)

    @classmethod
    def build_mlp(cls, config, layer_idx: int, options=None) -> nn.Module:
        return PackedGatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act)


class Phi3Model(Phi3PreTrainedModel, llama.LlamaModel):
    hf_twin = transformers.Phi3Model


Phi3PreTrainedModel.base_model_class = Phi3Model


class Phi3ForCausalLM(Phi3PreTrainedModel, llama.LlamaForCausalLM):
    hf_twin = transformers.Phi3ForCausalLM

    def prepare_inputs_for_generation(self, input_ids, cache=None, **kwargs):
        """``transformers``' Phi-3 rule: when the sequence first grows past ``original_max_position_embeddings``,
        the rotary switches from the short to the long factors, so the cache (keys rotated with the short ones) is
        dropped and this step recomputes the whole sequence."""
        original = getattr(self.config, "original_max_position_embeddings", None)
        if cache and original is not None and input_ids.shape[1] >= original + 1 \
                and cache.get_seq_length() <= original:
            cache, kwargs["next_sequence_length"] = None, None
        return super().prepare_inputs_for_generation(input_ids, cache=cache, **kwargs)


class Phi3ForSequenceClassification(Phi3PreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin = transformers.Phi3ForSequenceClassification


class Phi3ForTokenClassification(Phi3PreTrainedModel, llama.LlamaForTokenClassification):
    hf_twin = transformers.Phi3ForTokenClassification
