"""Phi, written single-device with the module tree and state-dict keys of ``transformers``' Phi.

What is particular to it, and where it lives:

- the block is the parallel-residual template with one norm (``input_layernorm``): ``drop(attn(ln(x))) +
  drop(mlp(ln(x))) + x``, one ``resid_dropout`` for both branches (on the residual stream);
- the attention is ``GroupedQueryAttention`` with q/k/v biases, a biased output projection named ``dense``, partial
  rotary (``partial_rotary_factor``: ``PartialRotaryEmbedding``) and, with ``qk_layernorm``, LayerNorms over
  ``head_dim`` on the queries and keys before rotary (``q_layernorm``/``k_layernorm``); under tensor parallelism
  each rank normalizes its own heads with the replicated weights, whose gradients are summed over TP
  (``HeadLayerNormStyle``);
- ``final_layernorm``, ``embed_dropout`` and a biased ``lm_head``.

The forward is the shared stack (``common/stack/stack.py``); plan and divisibility checks come from ``PHI_SPEC``'s
components; the heads are the generic ones (``models/heads.py``).

Shapes: b batch, s sequence, h hidden, n query heads (n/tp per rank), n_kv key/value heads, d head dim.
"""
from __future__ import annotations

import torch
import transformers
from transformers.generation import GenerationMixin

from ...parallel_layers.kv_heads import KVHeadColwise
from ...parallel_layers.layers import Dropout
from ...parallel_layers.layers import LayerNorm as PlainLayerNorm
from ...parallel_layers.plan import Colwise, Rowwise, TPDropout
from ..common.attention.attention import GroupedQueryAttention
from ..common.embeddings.rotary import PartialRotaryEmbedding
from ..common.feed_forward.mlp import DenseMLP
from ..common.norms.layer_norm import HeadLayerNormStyle, LayerNorm
from ..common.rules.capabilities import Capabilities
from ..common.stack.blocks import ParallelResidualBlock
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import EmbeddingDropout, FinalNorm, Layers, Rotary, TokenEmbedding, layer_norm
from ..heads import ForCausalLM, ForSequenceClassification, ForTokenClassification, StackFamilyModel
from ..modeling_utils import OsloPreTrainedModel
from .configuration_phi import PhiConfig


class PhiAttention(GroupedQueryAttention):
    """Biased ``q_proj``/``k_proj``/``v_proj`` (by query / key-value heads) and ``dense`` (row-parallel); with
    ``qk_layernorm``, ``q_layernorm``/``k_layernorm`` over ``head_dim`` on this rank's heads, before rotary."""

    out_name = "dense"
    tp_plan = {"q_proj": Colwise(), "k_proj": KVHeadColwise(), "v_proj": KVHeadColwise(), "dense": Rowwise(),
               "q_layernorm": HeadLayerNormStyle(), "k_layernorm": HeadLayerNormStyle(),
               "attn_dropout": TPDropout(always_split=True)}

    def __init__(self, config: PhiConfig, layer_idx: int):
        super().__init__(config, layer_idx, qkv_bias=True, o_bias=True)
        if config.qk_layernorm:
            width = config.hidden_size // config.num_attention_heads  # transformers' width (= head_dim)
            self.q_layernorm = PlainLayerNorm(width, eps=config.layer_norm_eps)
            self.k_layernorm = PlainLayerNorm(width, eps=config.layer_norm_eps)

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = super().project(hidden_states)  # [b, n/tp, s, d], [b, n_kv/tp, s, d] x 2
        if hasattr(self, "q_layernorm"):
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        return query, key, value


class PhiMLP(DenseMLP):
    names = ("fc1", "fc2")


class PhiDecoderLayer(ParallelResidualBlock):
    """``drop(attn(ln(x))) + drop(mlp(ln(x))) + x`` with one ``input_layernorm`` and one ``resid_dropout``."""

    names = dict(attn_norm="input_layernorm", attn="self_attn", mlp="mlp")

    def __init__(self, config: PhiConfig, layer_idx: int):
        # registered in transformers' order (self_attn, mlp, input_layernorm, resid_dropout)
        super().__init__(attn=PhiAttention(config, layer_idx),
                         mlp=PhiMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act),
                         attn_norm=LayerNorm(config.hidden_size, eps=config.layer_norm_eps),
                         order=("attn", "mlp", "attn_norm"))
        self.resid_dropout = Dropout(config.resid_pdrop)

    @classmethod
    def tp_plan(cls, components) -> dict:
        # the residual dropout acts on the residual stream: per-rank masks only under sequence parallelism
        return {**super().tp_plan(components), "resid_dropout": TPDropout()}

    def attend(self, x, attention_mask, position_embeddings, past_key_values, **kwargs):
        return self.resid_dropout(super().attend(x, attention_mask, position_embeddings, past_key_values, **kwargs))

    def mlp_forward(self, x, **kwargs):
        return self.resid_dropout(super().mlp_forward(x, **kwargs))


PHI_SPEC = StackSpec(block=PhiDecoderLayer, components=dict(attn=PhiAttention, mlp=PhiMLP, attn_norm=LayerNorm),
                     parts=(TokenEmbedding("embed_tokens"), Layers("layers"),
                            Rotary("rotary_emb", PartialRotaryEmbedding), EmbeddingDropout("embed_dropout"),
                            FinalNorm("final_layernorm", layer_norm("layer_norm_eps"))))


class PhiPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = PhiConfig
    config: PhiConfig
    base_model_prefix = "model"
    stack_spec = PHI_SPEC
    supports_gradient_checkpointing = True
    # 3D tensor parallelism: position ids feed only the rotary attention, which runs in the inner layout
    grid_inner_inputs = ("attention_mask", "position_ids")


class PhiModel(TransformerStack, PhiPreTrainedModel):
    """``embed_tokens``, ``num_hidden_layers`` layers, the (partial) rotary embedding, ``embed_dropout`` and
    ``final_layernorm``; the forward is the shared stack's. Output ``last_hidden_state``: ``[b, s, h]``."""

    hf_twin = transformers.PhiModel
    is_base_model = True
    capabilities = Capabilities(context_parallel=True)



PhiPreTrainedModel.base_model_class = PhiModel


class PhiForCausalLM(ForCausalLM, PhiPreTrainedModel, GenerationMixin):
    hf_twin = transformers.PhiForCausalLM
    lm_head_bias = True


class PhiForSequenceClassification(ForSequenceClassification, PhiPreTrainedModel):
    hf_twin = transformers.PhiForSequenceClassification


class PhiForTokenClassification(ForTokenClassification, PhiPreTrainedModel):
    hf_twin = transformers.PhiForTokenClassification
