"""GPT-2, written single-device with the module tree and state-dict keys of ``transformers``' GPT-2.

The block is the pre-norm template (``common/stack/blocks.py``) under GPT-2's names (``ln_1``, ``attn``, ``ln_2``,
``mlp``); the forward is the shared stack (``common/stack/stack.py``: token + learned position embeddings, the
sequence-parallel scatter and embedding dropout, the blocks, ``ln_f`` and the gather back), so every public tensor
keeps HF's ``[batch, seq, hidden]`` layout. The parallel plan and the divisibility checks come from ``GPT2_SPEC``'s
components; the heads are the generic ones (``models/heads.py``). Attention runs through ``transformers``'
attention interface (SDPA by default) on this rank's heads.

Shapes: b batch, s sequence, h hidden, n heads (n/tp per rank), d head dim, V vocabulary.
"""
from __future__ import annotations

import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithCrossAttentions
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward
from transformers.utils.output_capturing import OutputRecorder

from ...config import ParallelConfig
from ...parallel_layers.layers import Dropout, Linear
from ...parallel_layers.plan import Colwise, Rowwise, TPDropout
from ..common.attention.attention import AttentionModule, attend
from ..common.feed_forward.bias_act import fused_gelu_approximation, linear_act
from ..common.norms.layer_norm import LayerNorm
from ..common.rules.capabilities import Capabilities
from ..common.rules.parallel_rules import Features, Heads, check_head_size
from ..common.stack.blocks import PreNormBlock
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import (
    EmbeddingDropout,
    FinalNorm,
    Layers,
    PositionEmbedding,
    TokenEmbedding,
    layer_norm,
)
from ..heads import (
    ForCausalLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    StackFamilyModel,
)
from ..modeling_utils import OsloPreTrainedModel
from .configuration_gpt2 import GPT2Config


def _inner_size(config) -> int:
    return config.n_inner if config.n_inner is not None else 4 * config.hidden_size


class GPT2Attention(AttentionModule):
    """``c_attn`` packs q|k|v along its output (``Conv1D`` layout ``[h, 3h]``), so it is split per block: rank r
    keeps heads ``r*n/tp ..`` of q, of k and of v; ``c_proj`` row-parallel. Returns ``(output, weights)``."""

    tp_plan = {"c_attn": Colwise(num_packed=3), "c_proj": Rowwise(), "attn_dropout": TPDropout(always_split=True),
               "resid_dropout": TPDropout()}
    kernels = frozenset({"sdpa", "flash_attn", "attention_backend"})  # as transformers' GPT-2: no flex

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("num_attention_heads", config.num_attention_heads)]

    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.head_dim = self.embed_dim // config.num_attention_heads
        self.layer_idx = layer_idx
        self.is_causal = True
        self.scaling = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_idx + 1)
        self.c_attn = Linear(self.embed_dim, 3 * self.embed_dim, layout="conv1d")
        self.c_proj = Linear(self.embed_dim, self.embed_dim, layout="conv1d")
        self.attn_dropout = Dropout(config.attn_pdrop)
        self.resid_dropout = Dropout(config.resid_pdrop)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                **kwargs):
        qkv = self.c_attn(hidden_states)  # [b, s, 3*h/tp]
        query, key, value = qkv.chunk(3, dim=-1)  # each [b, s, (n/tp)*d]: this rank's heads
        shape = (*query.shape[:-1], -1, self.head_dim)
        query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))  # [b, n/tp, s, d]
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.attn_dropout,  # [b, s, h/tp]
                              scaling=self.scaling, eager_fallback=eager_attention_forward, **kwargs)
        return self.resid_dropout(self.c_proj(out)), weights  # [b, s(/tp), h]


class GPT2MLP(nn.Module):
    """``c_fc`` column-, ``c_proj`` row-parallel; the GELU (fused with ``c_fc``'s bias on CUDA) between them."""

    tp_plan = {"c_fc": Colwise(), "c_proj": Rowwise(), "dropout": TPDropout()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Features("n_inner", _inner_size(config))]

    def __init__(self, intermediate_size: int, config: GPT2Config):
        super().__init__()
        self.c_fc = Linear(config.hidden_size, intermediate_size, layout="conv1d")
        self.c_proj = Linear(intermediate_size, config.hidden_size, layout="conv1d")
        self.config_act = config.activation_function
        self.act = ACT2FN[config.activation_function]
        self.dropout = Dropout(config.resid_pdrop)
        self.fused_gelu = None  # bias_gelu's ``approximate`` when the fused bias-GELU runs (configure_fused_ops)

    def configure_fused_ops(self, enabled: bool) -> None:
        self.fused_gelu = fused_gelu_approximation(enabled, self.config_act, self.c_fc)

    def forward(self, hidden_states):
        hidden_states = linear_act(self.c_fc, self.act, hidden_states, approximate=self.fused_gelu)  # [b, s, i/tp]
        return self.dropout(self.c_proj(hidden_states))


class GPT2Block(PreNormBlock):
    names = dict(attn_norm="ln_1", attn="attn", mlp_norm="ln_2", mlp="mlp")

    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__(attn_norm=LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon),
                         attn=GPT2Attention(config, layer_idx),
                         mlp_norm=LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon),
                         mlp=GPT2MLP(_inner_size(config), config))


GPT2_SPEC = StackSpec(block=GPT2Block,
                      components=dict(attn_norm=LayerNorm, attn=GPT2Attention, mlp_norm=LayerNorm, mlp=GPT2MLP),
                      parts=(TokenEmbedding("wte", padding=False), PositionEmbedding("wpe"), EmbeddingDropout("drop"),
                             Layers("h"), FinalNorm("ln_f", layer_norm("layer_norm_epsilon"))),
                      token_types_through_tokens=True)


class GPT2PreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = GPT2Config
    config: GPT2Config
    base_model_prefix = "transformer"
    stack_spec = GPT2_SPEC
    supports_gradient_checkpointing = True
    _keys_to_ignore_on_load_unexpected = ["attn.bias", "attn.masked_bias", "crossattention.bias"]
    # as transformers' GPT-2 (cross-attentions: a key that stays empty, cross-attention is refused at build)
    _can_record_outputs = {"hidden_states": GPT2Block,
                           "attentions": OutputRecorder(GPT2Attention, layer_name=".attn", index=1),
                           "cross_attentions": OutputRecorder(GPT2Attention, layer_name=".crossattention", index=1)}

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)  # the components' rules: heads, n_inner
        check_head_size(config, "GPT-2", hidden="n_embd", heads="n_head")
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError("GPT-2 with add_cross_attention=True is not implemented yet")


class GPT2Model(TransformerStack, GPT2PreTrainedModel):
    """Embeddings, ``n_layer`` blocks and the final norm; the forward is the shared stack's. Output
    ``last_hidden_state``: ``[b, s, h]``."""

    hf_twin = transformers.GPT2Model
    is_base_model = True
    output_class = BaseModelOutputWithPastAndCrossAttentions
    capabilities = Capabilities(context_parallel=True)



GPT2PreTrainedModel.base_model_class = GPT2Model


class GPT2LMHeadModel(ForCausalLM, GPT2PreTrainedModel, GenerationMixin):
    """GPT-2 with the LM head tied to ``wte`` (see ``ForCausalLM``); pipeline stages also under the grid modes."""

    hf_twin = transformers.GPT2LMHeadModel
    output_class = CausalLMOutputWithCrossAttentions
    pipeline_grid_modes = True


class GPT2ForSequenceClassification(ForSequenceClassification, GPT2PreTrainedModel):
    hf_twin = transformers.GPT2ForSequenceClassification


class GPT2ForTokenClassification(ForTokenClassification, GPT2PreTrainedModel):
    hf_twin = transformers.GPT2ForTokenClassification
    classifier_name = "classifier"


class GPT2ForQuestionAnswering(ForQuestionAnswering, GPT2PreTrainedModel):
    hf_twin = transformers.GPT2ForQuestionAnswering
