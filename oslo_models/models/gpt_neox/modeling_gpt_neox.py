"""GPT-NeoX, written single-device with the module tree and state-dict keys of ``transformers``' GPT-NeoX.

What is particular to it, and where it lives:

- ``query_key_value`` packs q|k|v *per head* (``[n, 3, d]`` rows): ``common/attention/packed_attention.py``
  (``HeadPackedAttention``), whose plain column split keeps each head's q, k and v on one rank;
- partial rotary (``rotary_pct`` -> ``rope_parameters["partial_rotary_factor"]``): ``PartialRotaryEmbedding`` gives
  ``cos``/``sin`` of the first ``rotary_dim`` dims, and the attention rotates only those;
- ``use_parallel_residual``: ``x + attn(ln1(x)) + mlp(ln2(x))`` (the parallel-residual template with two norms) or
  ``x + attn(ln1(x))`` then ``+ mlp(ln2(.))`` (the pre-norm template), one layer class for both, as in
  ``transformers``; the hidden dropouts (``post_attention_dropout``/``post_mlp_dropout``) act on the residual
  stream, so they split their RNG stream only under sequence parallelism;
- the LM head is ``lm_head`` in memory and ``embed_out`` in checkpoints, both ways (``common/loading/renamed_keys.py``),
  as ``transformers`` 5 loads and saves it.

The forward is the shared stack (``common/stack/stack.py``); plan and divisibility checks come from ``GPT_NEOX_SPEC``'s
components; the heads are the generic ones (``models/heads.py``).

Shapes: b batch, s sequence, h hidden, n heads (n/tp per rank), d head dim, V vocabulary.
"""
from __future__ import annotations

import transformers
from transformers.generation import GenerationMixin

from ...parallel_layers.layers import Dropout
from ...parallel_layers.plan import TPDropout
from ..common.attention.packed_attention import HeadPackedAttention
from ..common.embeddings.rotary import PartialRotaryEmbedding
from ..common.feed_forward.mlp import DenseMLP
from ..common.loading.renamed_keys import RenamedHubKeys
from ..common.norms.layer_norm import LayerNorm
from ..common.rules.capabilities import Capabilities
from ..common.stack.blocks import ParallelResidualBlock, PreNormBlock
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import EmbeddingDropout, FinalNorm, Layers, Rotary, TokenEmbedding, layer_norm
from ..heads import (
    ForCausalLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    StackFamilyModel,
)
from ..modeling_utils import OsloPreTrainedModel
from .configuration_gpt_neox import GPTNeoXConfig


class GPTNeoXAttention(HeadPackedAttention):
    """``query_key_value`` (per-head packed, column-parallel by whole heads) and ``dense`` (row-parallel), biased when
    ``attention_bias``; partial rotary; attention-probability dropout ``attention_dropout``."""

    def __init__(self, config: GPTNeoXConfig, layer_idx: int):
        super().__init__(config, layer_idx, bias=config.attention_bias, attention_dropout=config.attention_dropout)


class GPTNeoXMLP(DenseMLP):
    names = ("dense_h_to_4h", "dense_4h_to_h")


class GPTNeoXLayer(ParallelResidualBlock):
    """``use_parallel_residual=True``: ``x + drop(attn(ln1(x))) + drop(mlp(ln2(x)))``; ``False``: ``y = x +
    drop(attn(ln1(x)))``, then ``y + drop(mlp(ln2(y)))`` (the pre-norm template's forward on the same roles)."""

    names = dict(attn_norm="input_layernorm", attn="attention", mlp_norm="post_attention_layernorm", mlp="mlp")

    def __init__(self, config: GPTNeoXConfig, layer_idx: int):
        def norm():
            return LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

        # registered in transformers' order (input_layernorm, post_attention_layernorm, ..., attention, mlp)
        super().__init__(attn_norm=norm(), mlp_norm=norm(), attn=GPTNeoXAttention(config, layer_idx),
                         mlp=GPTNeoXMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act),
                         order=("attn_norm", "mlp_norm", "attn", "mlp"))
        self.use_parallel_residual = config.use_parallel_residual
        self.post_attention_dropout = Dropout(config.hidden_dropout)
        self.post_mlp_dropout = Dropout(config.hidden_dropout)

    @classmethod
    def tp_plan(cls, components) -> dict:
        # the hidden dropouts act on the residual stream: per-rank masks only under sequence parallelism
        return {**super().tp_plan(components), "post_attention_dropout": TPDropout(), "post_mlp_dropout": TPDropout()}

    def attend(self, x, attention_mask, position_embeddings, past_key_values, **kwargs):
        return self.post_attention_dropout(super().attend(x, attention_mask, position_embeddings, past_key_values,
                                                          **kwargs))

    def mlp_forward(self, x, **kwargs):
        return self.post_mlp_dropout(super().mlp_forward(x, **kwargs))

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        block = ParallelResidualBlock if self.use_parallel_residual else PreNormBlock
        return block.forward(self, hidden_states, attention_mask, position_embeddings, past_key_values, **kwargs)


GPT_NEOX_SPEC = StackSpec(block=GPTNeoXLayer,
                          components=dict(attn_norm=LayerNorm, attn=GPTNeoXAttention, mlp_norm=LayerNorm,
                                          mlp=GPTNeoXMLP),
                          parts=(TokenEmbedding("embed_in", padding=False),
                                 EmbeddingDropout("emb_dropout", "hidden_dropout"), Layers("layers"),
                                 FinalNorm("final_layer_norm", layer_norm("layer_norm_eps")),
                                 Rotary("rotary_emb", PartialRotaryEmbedding)))


class GPTNeoXPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = GPTNeoXConfig
    config: GPTNeoXConfig
    base_model_prefix = "gpt_neox"
    stack_spec = GPT_NEOX_SPEC
    supports_gradient_checkpointing = True
    # old checkpoints' causal-mask and rotary buffers
    _keys_to_ignore_on_load_unexpected = ["attention.bias", "attention.masked_bias", "rotary_emb.inv_freq"]
    # 3D tensor parallelism: position ids feed only the rotary attention, which runs in the inner layout
    grid_inner_inputs = ("attention_mask", "position_ids")


class GPTNeoXModel(TransformerStack, GPTNeoXPreTrainedModel):
    """``embed_in``, ``emb_dropout``, ``num_hidden_layers`` layers, ``final_layer_norm`` and the (partial) rotary
    embedding; the forward is the shared stack's. Output ``last_hidden_state``: ``[b, s, h]``."""

    hf_twin = transformers.GPTNeoXModel
    is_base_model = True
    capabilities = Capabilities(context_parallel=True)



GPTNeoXPreTrainedModel.base_model_class = GPTNeoXModel


class GPTNeoXForCausalLM(RenamedHubKeys, ForCausalLM, GPTNeoXPreTrainedModel, GenerationMixin):
    """The LM head is ``lm_head`` (``transformers`` 5's module tree) and ``embed_out`` in checkpoints: Hub checkpoints
    load, and ``save_pretrained`` writes ``embed_out.weight`` as ``transformers`` does."""

    hf_twin = transformers.GPTNeoXForCausalLM
    hub_key_renames = (("embed_out.", "lm_head."),)


class GPTNeoXForSequenceClassification(ForSequenceClassification, GPTNeoXPreTrainedModel):
    hf_twin = transformers.GPTNeoXForSequenceClassification


class GPTNeoXForTokenClassification(ForTokenClassification, GPTNeoXPreTrainedModel):
    hf_twin = transformers.GPTNeoXForTokenClassification
    classifier_name = "classifier"


class GPTNeoXForQuestionAnswering(ForQuestionAnswering, GPTNeoXPreTrainedModel):
    hf_twin = transformers.GPTNeoXForQuestionAnswering
