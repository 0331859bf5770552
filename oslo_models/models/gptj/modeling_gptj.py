"""GPT-J, written single-device with the module tree and state-dict keys of ``transformers``' GPT-J.

What is particular to it, and where it lives:

- the block is the parallel-residual template with one shared norm: ``attn(ln_1(x)) + mlp(ln_1(x)) + x``;
- rotary is *interleaved* (pairs ``(x[2i], x[2i+1])`` rotate, ``rotate_every_two``) and partial (the first
  ``rotary_dim`` dims of each head): ``InterleavedRotaryEmbedding`` (``transformers``' sinusoid table) and the
  grouped-query attention's ``interleaved_rotary`` switch, both in ``common/``; the fused rotary kernel rotates
  halves, so this layout runs in torch;
- the attention is ``GroupedQueryAttention`` with as many key/value heads as query heads, no biases, the output
  projection named ``out_proj`` followed by ``resid_dropout``, and ``transformers``' GPT-J eager kernel (scores in
  fp32) for ``attn_implementation="eager"``;
- ``token_type_ids`` are embedded through ``wte`` and added, as in ``transformers``;
- the LM head has a bias (vocab-parallel like its weight).

The forward is the shared stack (``common/stack/stack.py``); plan and divisibility checks come from ``GPTJ_SPEC``'s
components; the heads are the generic ones (``models/heads.py``).

Shapes: b batch, s sequence, h hidden, n heads (n/tp per rank), d head dim, V vocabulary.
"""
from __future__ import annotations

import torch
import transformers
from transformers.generation import GenerationMixin

try:
    from transformers.models.gptj.modeling_gptj import eager_attention_forward
except ImportError:  # transformers < 5.2x (e.g. 5.17) computes GPT-J's eager attention inside GPTJAttention
    def eager_attention_forward(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                                **kwargs):
        """GPT-J's eager kernel: scores in fp32 (overflow), the softmax cast back to the value dtype."""
        weights = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = torch.nn.functional.softmax(weights, dim=-1).to(value.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

from ...parallel_layers.kv_heads import KVHeadColwise
from ...parallel_layers.layers import Dropout
from ...parallel_layers.plan import Colwise, Rowwise, TPDropout
from ..common.attention.attention import GroupedQueryAttention
from ..common.embeddings.rotary import InterleavedRotaryEmbedding
from ..common.feed_forward.mlp import DenseMLP
from ..common.norms.layer_norm import LayerNorm
from ..common.rules.capabilities import Capabilities
from ..common.stack.blocks import ParallelResidualBlock
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import EmbeddingDropout, FinalNorm, Layers, Rotary, TokenEmbedding, layer_norm
from ..heads import ForCausalLM, ForQuestionAnswering, ForSequenceClassification, StackFamilyModel
from ..modeling_utils import OsloPreTrainedModel
from .configuration_gptj import GPTJConfig


class GPTJAttention(GroupedQueryAttention):
    """``q_proj``/``k_proj``/``v_proj`` column-parallel by heads, ``out_proj`` row-parallel, no biases; interleaved
    partial rotary; ``attn_pdrop`` on the probabilities and ``resid_pdrop`` on the output (the residual stream)."""

    out_name = "out_proj"
    tp_plan = {"q_proj": Colwise(), "k_proj": KVHeadColwise(), "v_proj": KVHeadColwise(), "out_proj": Rowwise(),
               "attn_dropout": TPDropout(always_split=True), "resid_dropout": TPDropout()}

    def __init__(self, config: GPTJConfig, layer_idx: int):
        super().__init__(config, layer_idx, interleaved_rotary=True,
                         eager_fallback=eager_attention_forward)
        self.attn_dropout = Dropout(config.attn_pdrop)
        self.resid_dropout = Dropout(config.resid_pdrop)
        for name in ("k_proj", "v_proj", "q_proj", "out_proj"):  # transformers' registration order
            self._modules[name] = self._modules.pop(name)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        out, weights = super().forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        return self.resid_dropout(out), weights


class GPTJMLP(DenseMLP):
    names = ("fc_in", "fc_out")
    intermediate_attr = "n_inner"


class GPTJBlock(ParallelResidualBlock):
    """``attn(ln_1(x)) + mlp(ln_1(x)) + x``: one norm feeds both branches."""

    names = dict(attn_norm="ln_1", attn="attn", mlp="mlp")

    def __init__(self, config: GPTJConfig, layer_idx: int):
        inner = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        super().__init__(attn_norm=LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
                         attn=GPTJAttention(config, layer_idx),
                         mlp=GPTJMLP(config.n_embd, inner, act=config.activation_function,
                                     dropout=config.resid_pdrop))


GPTJ_SPEC = StackSpec(block=GPTJBlock, components=dict(attn_norm=LayerNorm, attn=GPTJAttention, mlp=GPTJMLP),
                      parts=(TokenEmbedding("wte", padding=False), EmbeddingDropout("drop"), Layers("h"),
                             FinalNorm("ln_f", layer_norm("layer_norm_epsilon")),
                             Rotary("rotary_emb", InterleavedRotaryEmbedding)),
                      token_types_through_tokens=True)


class GPTJPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = GPTJConfig
    config: GPTJConfig
    base_model_prefix = "transformer"
    stack_spec = GPTJ_SPEC
    supports_gradient_checkpointing = True
    _keys_to_ignore_on_load_unexpected = ["attn.bias", "attn.masked_bias"]  # old causal-mask buffers
    # 3D tensor parallelism: position ids feed only the rotary attention, which runs in the inner layout
    grid_inner_inputs = ("attention_mask", "position_ids")


class GPTJModel(TransformerStack, GPTJPreTrainedModel):
    """``wte``, ``drop``, ``n_layer`` blocks ``h``, ``ln_f`` and the interleaved rotary embedding; the forward is
    the shared stack's. Output ``last_hidden_state``: ``[b, s, h]``."""

    hf_twin = transformers.GPTJModel
    is_base_model = True
    capabilities = Capabilities(context_parallel=True)



GPTJPreTrainedModel.base_model_class = GPTJModel


class GPTJForCausalLM(ForCausalLM, GPTJPreTrainedModel, GenerationMixin):
    hf_twin = transformers.GPTJForCausalLM
    lm_head_bias = True


class GPTJForSequenceClassification(ForSequenceClassification, GPTJPreTrainedModel):
    hf_twin = transformers.GPTJForSequenceClassification


class GPTJForQuestionAnswering(ForQuestionAnswering, GPTJPreTrainedModel):
    hf_twin = transformers.GPTJForQuestionAnswering
