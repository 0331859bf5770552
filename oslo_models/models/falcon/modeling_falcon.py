"""Falcon, written single-device on the shared stack with the module tree and state-dict keys of ``transformers``'
Falcon (``transformer.word_embeddings``, ``h.N.self_attention.query_key_value``, ``h.N.ln_attn`` ...).

Its switches, and where each is decided:

- the fused ``query_key_value`` (``common/attention/grouped_qkv_attention.py``, ``FalconAttention.qkv_groups``):
  ``new_decoder_architecture`` packs ``num_kv_heads`` groups ``[q_1..q_G, k, v]``; otherwise ``multi_query`` packs
  ``[q_1..q_n, k, v]`` (one key/value head, replicated over tensor-parallel ranks, never refused) and
  ``multi_query=False`` ``[q, k, v]`` per head. Tensor parallelism keeps each rank's query heads with their
  key/value head (``parallel_layers/grouped_qkv.py``); ``bias`` adds biases to every linear;
- the block (``FalconDecoderLayer``): the parallel-residual template ``x + attn(norm1(x)) + mlp(norm2(x))`` with
  ``ln_attn`` + ``ln_mlp`` (new architecture, ``num_ln_in_parallel_attn`` 2, its default) or one shared
  ``input_layernorm`` (``num_ln_in_parallel_attn=1``, or the old architecture with ``parallel_attn``); the pre-norm
  template with ``input_layernorm`` / ``post_attention_layernorm`` for ``parallel_attn=False``;
- positions: rotary (``rotary_emb``), or with ``alibi=True`` an ALiBi bias in the mask built by the stack's
  ``layer_masks`` hook, for this rank's heads, with ``transformers``' Falcon arithmetic: slopes rounded to bfloat16,
  bias divided by ``sqrt(head_dim)`` (the SDPA path, ``transformers``' default for Falcon; its eager path adds the
  bias twice, which this model does not reproduce). Under context parallelism ``context_parallel_alibi`` gives
  the context-parallel mask the same slopes and divisor.

Dropouts follow ``transformers``: attention-probability dropout only with ALiBi; sequential blocks drop the attention
output with ``attention_dropout`` and the MLP output with ``hidden_dropout``; parallel blocks drop the sum of both
branches with ``hidden_dropout``, which the template does not express, so ``hidden_dropout > 0`` there is refused.

Shapes: b batch, s sequence, h hidden, n heads (n/tp per rank), d head dim.
"""
from __future__ import annotations

import math

import transformers
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithCrossAttentions

from ...config import ParallelConfig
from ..common.attention.causal_masks import FULL, packed_documents
from ..common.attention.grouped_qkv_attention import GroupedQKVAttention
from ..common.embeddings.positions import alibi_attention_mask, alibi_slopes
from ..common.embeddings.rotary import RotaryEmbedding
from ..common.feed_forward.mlp import DenseMLP
from ..common.norms.layer_norm import LayerNorm
from ..common.rules.capabilities import Capabilities
from ..common.rules.parallel_rules import check_head_size
from ..common.stack.blocks import ParallelResidualBlock, PreNormBlock
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import FinalNorm, Layers, Rotary, TokenEmbedding, layer_norm
from ..heads import (
    ForCausalLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    StackFamilyModel,
)
from ..modeling_utils import OsloPreTrainedModel
from .configuration_falcon import FalconConfig


def parallel_block(config) -> bool:
    """Whether attention and MLP read the same input (the new architecture always does)."""
    return bool(config.new_decoder_architecture or config.parallel_attn)


def two_norms(config) -> bool:
    """``ln_attn`` + ``ln_mlp`` (the new architecture's default) rather than one ``input_layernorm``."""
    return bool(config.new_decoder_architecture) and (config.num_ln_in_parallel_attn or 2) == 2


class FalconAttention(GroupedQKVAttention):
    """``query_key_value`` of ``qkv_groups`` groups, ``dense``; rotary, or ALiBi through the mask."""

    kernels = frozenset({"sdpa", "flash_attn", "attention_backend"})  # as transformers' Falcon: no flex

    @classmethod
    def qkv_groups(cls, config) -> int:
        if config.new_decoder_architecture:
            return config.num_kv_heads
        return 1 if config.multi_query else config.num_attention_heads


class FalconMLP(DenseMLP):
    """``dense_4h_to_h(act(dense_h_to_4h(x)))`` (``activation``, ``ffn_hidden_size``, ``bias``)."""

    names = ("dense_h_to_4h", "dense_4h_to_h")
    intermediate_attr = "ffn_hidden_size"


class FalconDecoderLayer(ParallelResidualBlock):
    """Parallel residual (new architecture, or ``parallel_attn``) or pre-norm (``parallel_attn=False``); the norms'
    ``transformers`` names depend on the config, so ``names`` is set per instance."""

    names = dict(attn_norm="input_layernorm", attn="self_attention", mlp_norm="post_attention_layernorm", mlp="mlp")

    def __init__(self, config: FalconConfig, layer_idx: int):
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.parallel = parallel_block(config)
        attention = FalconAttention(config, layer_idx, bias=config.bias, rotary=not config.alibi,
                                    attention_dropout=config.attention_dropout if config.alibi else 0.0,
                                    output_dropout=0.0 if self.parallel else config.attention_dropout)
        mlp = FalconMLP(hidden, config.ffn_hidden_size, act=config.activation, bias=config.bias,
                        dropout=0.0 if self.parallel else config.hidden_dropout)
        if two_norms(config):
            self.names = dict(self.names, attn_norm="ln_attn", mlp_norm="ln_mlp")
            order = ("attn", "mlp", "attn_norm", "mlp_norm")
        else:  # transformers registers post_attention_layernorm before input_layernorm
            order = ("attn", "mlp", "mlp_norm", "attn_norm")
        shared = self.parallel and not two_norms(config)  # one input_layernorm feeds both branches
        super().__init__(attn=attention, mlp=mlp, attn_norm=LayerNorm(hidden, eps=eps),
                         mlp_norm=None if shared else LayerNorm(hidden, eps=eps), order=order)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        template = ParallelResidualBlock if self.parallel else PreNormBlock
        return template.forward(self, hidden_states, attention_mask, position_embeddings, past_key_values, **kwargs)


# The block's class-level names are the sequential ones; the new architecture's two norms are planned here too.
FALCON_SPEC = StackSpec(block=FalconDecoderLayer,
                        components=dict(attn_norm=LayerNorm, attn=FalconAttention, mlp_norm=LayerNorm, mlp=FalconMLP),
                        parts=(TokenEmbedding("word_embeddings", padding=False), Layers("h"),
                               FinalNorm("ln_f", layer_norm("layer_norm_epsilon")),
                               Rotary("rotary_emb", RotaryEmbedding)),
                        extra_plan={f"h.*.{name}": style for name in ("ln_attn", "ln_mlp")
                                    for style in LayerNorm.tp_plan.values()})


class FalconPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = FalconConfig
    config: FalconConfig
    base_model_prefix = "transformer"
    stack_spec = FALCON_SPEC
    supports_gradient_checkpointing = True

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)  # heads, the fused q|k|v groups, ffn_hidden_size
        check_head_size(config, "Falcon")
        if config.new_decoder_architecture and not config.parallel_attn:
            raise ValueError("Falcon with new_decoder_architecture=True needs parallel_attn=True (transformers' "
                             "Falcon cannot run the other combination either)")
        if not config.new_decoder_architecture and config.parallel_attn and config.num_ln_in_parallel_attn == 2:
            raise ValueError("Falcon's num_ln_in_parallel_attn=2 needs new_decoder_architecture=True (transformers' "
                             "Falcon builds ln_attn/ln_mlp but runs input_layernorm otherwise)")
        if parallel_block(config) and config.hidden_dropout:
            raise NotImplementedError(f"Falcon's parallel block drops the sum of attention and MLP outputs "
                                      f"(hidden_dropout={config.hidden_dropout}); that dropout is not implemented: "
                                      "load the model with hidden_dropout=0")


class FalconModel(TransformerStack, FalconPreTrainedModel):
    """Token embedding, ``num_hidden_layers`` blocks, ``ln_f`` and the rotary embedding (kept with ALiBi, as in
    ``transformers``: no parameters); the forward is the shared stack's. Output ``last_hidden_state``: ``[b, s, h]``."""

    hf_twin = transformers.FalconModel
    is_base_model = True
    output_class = BaseModelOutputWithPastAndCrossAttentions
    capabilities = Capabilities(context_parallel=True)

    def _local_slopes(self, device):
        """This tensor-parallel rank's ALiBi slopes, rounded to bfloat16 as ``transformers``' Falcon does."""
        context = self.parallel_context
        heads = self.config.num_attention_heads
        per_rank = heads // context.tp_size
        first = context.tp_rank * per_rank
        return alibi_slopes(heads, device).bfloat16()[first:first + per_rank]

    def _alibi_divisor(self) -> float:
        """``sqrt(head_dim)``, which ``transformers``' Falcon divides the ALiBi bias by."""
        return math.sqrt(self.config.hidden_size // self.config.num_attention_heads)

    def context_parallel_alibi(self, device):
        """ALiBi: ``(bfloat16 slopes [n/tp], sqrt(head_dim))`` for the context-parallel mask; rotary: ``None``."""
        if not self.config.alibi:
            return None
        return self._local_slopes(device), self._alibi_divisor()

    def layer_masks(self, shape_like, attention_mask, past_key_values, position_ids, kinds) -> dict:
        """Rotary: the causal masks of ``transformers``. ALiBi: ``{"full_attention": [b, n/tp, s, k]}``, the causal
        padding mask with the bias of this rank's heads in it (bfloat16 slopes, divided by ``sqrt(head_dim)``)."""
        if not self.config.alibi:
            return super().layer_masks(shape_like, attention_mask, past_key_values, position_ids, kinds)
        slopes = self._local_slopes(shape_like.device)
        documents = packed_documents(shape_like, attention_mask, past_key_values, position_ids)
        return {FULL: alibi_attention_mask(attention_mask, shape_like, past_key_values, slopes,
                                           divisor=self._alibi_divisor(), documents=documents)}


FalconPreTrainedModel.base_model_class = FalconModel


class FalconForCausalLM(ForCausalLM, FalconPreTrainedModel, GenerationMixin):
    """Falcon with the LM head (tied to ``word_embeddings`` when ``tie_word_embeddings``)."""

    hf_twin = transformers.FalconForCausalLM
    output_class = CausalLMOutputWithCrossAttentions


class FalconForSequenceClassification(ForSequenceClassification, FalconPreTrainedModel):
    hf_twin = transformers.FalconForSequenceClassification


class FalconForTokenClassification(ForTokenClassification, FalconPreTrainedModel):
    hf_twin = transformers.FalconForTokenClassification
    classifier_name = "classifier"


class FalconForQuestionAnswering(ForQuestionAnswering, FalconPreTrainedModel):
    hf_twin = transformers.FalconForQuestionAnswering
