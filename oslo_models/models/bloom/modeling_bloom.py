"""Bloom, written single-device on the shared stack with the module tree and state-dict keys of ``transformers``'
Bloom (``transformer.word_embeddings``, ``word_embeddings_layernorm``, ``h.N.self_attention.query_key_value``, ...).

What is particular to Bloom, and where it lives:

- ALiBi instead of positions: the stack's ``layer_masks`` hook builds, once per forward, the additive mask of this
  rank's heads ``[b, n/tp, s, k]``: head ``i``'s bias ``slope_i * (key position counted over the unmasked keys)``
  where a key is visible, the dtype's minimum elsewhere (``common/embeddings/positions.py``). Each tensor-parallel rank
  takes the slopes of the heads it holds (``local_alibi_slopes``), so no collective is involved;
- ``query_key_value`` packs ``[q, k, v]`` per head: split by whole heads
  (``common/attention/grouped_qkv_attention.py``);
- ``word_embeddings_layernorm`` after the token embedding (the spec's ``embedding_norm``);
- ``apply_residual_connection_post_layernorm``: the pre-norm template's ``residual_after_norm``;
- the MLP's GELU is ``transformers``' own Bloom GELU function (its tanh constants and hand-written backward).

Under context parallelism the stack's mask is the ``ContextParallelMask`` and ``context_parallel_alibi`` gives it
this rank's slopes: the ring / all-to-all cores add each key's bias from its position on the whole row
(``parallel_layers/context_parallel/mask.AlibiBias``). ``pretraining_tp``/``slow_but_exact`` only change the
summation order of ``dense``; they are accepted and ignored, as the plain layers compute the same product.

Shapes: b batch, s sequence, k key length (cache included), h hidden, n heads (n/tp per rank), d head dim.
"""
from __future__ import annotations

import transformers
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithCrossAttentions
from transformers.models.bloom.modeling_bloom import GeLUFunction

from ...config import ParallelConfig
from ..common.attention.causal_masks import FULL, packed_documents
from ..common.attention.grouped_qkv_attention import GroupedQKVAttention
from ..common.embeddings.positions import alibi_attention_mask, local_alibi_slopes
from ..common.feed_forward.mlp import DenseMLP
from ..common.norms.layer_norm import LayerNorm
from ..common.rules.parallel_rules import Features, check_head_size
from ..common.stack.blocks import PreNormBlock
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import EmbeddingNorm, FinalNorm, Layers, TokenEmbedding, layer_norm
from ..heads import (
    ForCausalLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    StackFamilyModel,
)
from ..modeling_utils import OsloPreTrainedModel
from .configuration_bloom import BloomConfig


class BloomAttention(GroupedQKVAttention):
    """``query_key_value`` ``[n x (q, k, v)]`` (one group per head), ``dense``; positions come from the ALiBi mask
    (the eager kernel only, as ``transformers``' Bloom)."""

    kernels = frozenset()


class BloomMLP(DenseMLP):
    """``dense_4h_to_h(gelu(dense_h_to_4h(x)))`` then the residual dropout (``hidden_dropout``)."""

    names = ("dense_h_to_4h", "dense_4h_to_h")

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Features("4 * hidden_size", 4 * config.hidden_size)]


class BloomBlock(PreNormBlock):
    """Pre-norm block; with ``apply_residual_connection_post_layernorm`` each residual is the normalized input."""

    names = dict(attn_norm="input_layernorm", attn="self_attention", mlp_norm="post_attention_layernorm", mlp="mlp")

    def __init__(self, config: BloomConfig, layer_idx: int):
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        super().__init__(attn_norm=LayerNorm(hidden, eps=eps),
                         attn=BloomAttention(config, layer_idx, attention_dropout=config.attention_dropout,
                                             output_dropout=config.hidden_dropout),
                         mlp_norm=LayerNorm(hidden, eps=eps),
                         mlp=BloomMLP(hidden, 4 * hidden, act=GeLUFunction.apply, dropout=config.hidden_dropout))
        self.residual_after_norm = bool(config.apply_residual_connection_post_layernorm)


BLOOM_SPEC = StackSpec(block=BloomBlock,
                       components=dict(attn_norm=LayerNorm, attn=BloomAttention, mlp_norm=LayerNorm, mlp=BloomMLP),
                       parts=(TokenEmbedding("word_embeddings", padding=False),
                              EmbeddingNorm("word_embeddings_layernorm", layer_norm("layer_norm_epsilon")), Layers("h"),
                              FinalNorm("ln_f", layer_norm("layer_norm_epsilon"))))


class BloomPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = BloomConfig
    config: BloomConfig
    base_model_prefix = "transformer"
    stack_spec = BLOOM_SPEC
    supports_gradient_checkpointing = True
    # eager, as transformers' Bloom: SDPA takes the ALiBi mask as well and gives the same outputs, but its backward
    # through a query that sees no key (a left-padded position) differs from eager autograd's

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)  # heads, the fused q|k|v groups, 4h
        check_head_size(config, "Bloom", heads="n_head")


class BloomModel(TransformerStack, BloomPreTrainedModel):
    """Token embedding and its LayerNorm, ``n_layer`` blocks and ``ln_f``; the forward is the shared stack's, with
    the ALiBi mask from ``layer_masks``. Output ``last_hidden_state``: ``[b, s, h]``."""

    hf_twin = transformers.BloomModel
    is_base_model = True
    output_class = BaseModelOutputWithPastAndCrossAttentions

    def context_parallel_alibi(self, device):
        """``(slopes [n/tp], 1.0)``: this rank's ALiBi slopes for the context-parallel mask (unscaled, fp32)."""
        context = self.parallel_context
        return local_alibi_slopes(self.config.num_attention_heads, context.tp_rank, context.tp_size, device), 1.0

    def layer_masks(self, shape_like, attention_mask, past_key_values, position_ids, kinds) -> dict:
        """``{"full_attention": [b, n/tp, s, k]}``: the causal padding mask with this rank's ALiBi bias in it."""
        context = self.parallel_context
        heads = self.config.num_attention_heads
        slopes = local_alibi_slopes(heads, context.tp_rank, context.tp_size, shape_like.device)
        documents = packed_documents(shape_like, attention_mask, past_key_values, position_ids)
        return {FULL: alibi_attention_mask(attention_mask, shape_like, past_key_values, slopes, documents=documents)}


BloomPreTrainedModel.base_model_class = BloomModel


class BloomForCausalLM(ForCausalLM, BloomPreTrainedModel, GenerationMixin):
    """Bloom with the LM head tied to ``word_embeddings``."""

    hf_twin = transformers.BloomForCausalLM
    output_class = CausalLMOutputWithCrossAttentions


class BloomForSequenceClassification(ForSequenceClassification, BloomPreTrainedModel):
    hf_twin = transformers.BloomForSequenceClassification


class BloomForTokenClassification(ForTokenClassification, BloomPreTrainedModel):
    hf_twin = transformers.BloomForTokenClassification
    classifier_name = "classifier"


class BloomForQuestionAnswering(ForQuestionAnswering, BloomPreTrainedModel):
    hf_twin = transformers.BloomForQuestionAnswering
