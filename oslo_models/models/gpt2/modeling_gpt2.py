"""GPT-2, written single-device with the module tree and state-dict keys of ``transformers``' GPT-2.

Parallelism enters only through the layers the plan (``parallel_plan.py``) swaps in, and through two explicit
sequence-parallel boundaries in ``GPT2Model.forward``: after the embeddings the residual stream is scattered
along the sequence (``[b, s, h] -> [b, s/tp, h]``), and after ``ln_f`` it is gathered back, so every public
tensor keeps HF's ``[batch, seq, hidden]`` layout. Attention runs through ``transformers``' attention interface
(SDPA by default) on this rank's heads.

Shapes: b batch, s sequence, h hidden, n heads (n/tp per rank), d head dim, V vocabulary.
"""
from __future__ import annotations

import logging

import torch
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    SequenceClassifierOutputWithPast,
)
from transformers.utils.generic import can_return_tuple
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

from ...config import ParallelConfig
from ...parallel_layers.layers import Dropout, Embedding, LayerNorm, Linear
from ...parallel_layers.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from ..common.attention import AttentionModule, attend
from ..common.bias_act import fused_gelu_approximation, linear_act
from ..common.context_parallel import causal_lm_head_outputs, context_parallel_inputs
from ..common.outputs import OutputCollector, passed_on
from ..heads import (last_token_logits, question_answering_output, sequence_classification_loss,
                     token_classification_output)
from ..modeling_utils import OsloPreTrainedModel
from .configuration_gpt2 import GPT2Config
from .parallel_plan import GPT2_BASE_PLAN, GPT2_HEAD_PLAN, GPT2_LM_PLAN
from .pipeline_gpt2 import GPT2LMPipelineAdapter

logger = logging.getLogger(__name__)


class GPT2Attention(AttentionModule):
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

    def forward(self, hidden_states, *, attention_mask=None, past_key_values=None, sequence_parallel=False,
                outputs=None, **kwargs):
        qkv = self.c_attn(hidden_states, sequence_parallel=sequence_parallel)  # [b, s, 3*h/tp]
        query, key, value = qkv.chunk(3, dim=-1)  # each [b, s, (n/tp)*d]: this rank's heads
        shape = (*query.shape[:-1], -1, self.head_dim)
        query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))  # [b, n/tp, s, d]
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)

        out, weights = attend(self, query, key, value, attention_mask, dropout=self.attn_dropout,  # [b, s, h/tp]
                              scaling=self.scaling, eager_fallback=eager_attention_forward, **kwargs)
        if outputs is not None:
            outputs.attention(weights)  # [b, n/tp, s, s_k] -> all heads
        out = self.c_proj(out, sequence_parallel=sequence_parallel)  # [b, s(/tp), h]
        return self.resid_dropout(out, sequence_parallel=sequence_parallel)


class GPT2MLP(nn.Module):
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

    def forward(self, hidden_states, *, sequence_parallel=False):
        hidden_states = linear_act(self.c_fc, self.act, hidden_states, approximate=self.fused_gelu,
                                   sequence_parallel=sequence_parallel)  # [b, s, i/tp]
        hidden_states = self.c_proj(hidden_states, sequence_parallel=sequence_parallel)
        return self.dropout(hidden_states, sequence_parallel=sequence_parallel)


class GPT2Block(GradientCheckpointingLayer):
    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
        self.ln_1 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(inner_dim, config)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, *, sequence_parallel=False,
                outputs=None, **kwargs):
        sp = sequence_parallel
        attn_output = self.attn(self.ln_1(hidden_states, sequence_parallel=sp), attention_mask=attention_mask,
                                past_key_values=past_key_values, sequence_parallel=sp, outputs=outputs, **kwargs)
        hidden_states = attn_output + hidden_states
        return hidden_states + self.mlp(self.ln_2(hidden_states, sequence_parallel=sp), sequence_parallel=sp)


class GPT2PreTrainedModel(OsloPreTrainedModel):
    config_class = GPT2Config
    config: GPT2Config
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GPT2Block"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    _keys_to_ignore_on_load_unexpected = ["attn.bias", "attn.masked_bias", "crossattention.bias"]

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        tp = parallel.tensor_parallel_size
        if config.num_attention_heads % tp:
            raise ValueError(f"GPT-2 num_attention_heads={config.num_attention_heads} is not divisible by "
                             f"tensor_parallel_size={tp}")
        inner = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
        if inner % tp:
            raise ValueError(f"GPT-2 n_inner={inner} is not divisible by tensor_parallel_size={tp}")
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"GPT-2 n_embd={config.hidden_size} is not divisible by n_head="
                             f"{config.num_attention_heads}")
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError("GPT-2 with add_cross_attention=True is not implemented yet")


class GPT2Model(GPT2PreTrainedModel):
    """Embeddings, ``n_layer`` blocks and the final norm. Output ``last_hidden_state``: ``[b, s, h]``."""

    parallel_plan = GPT2_BASE_PLAN
    hf_twin = transformers.GPT2Model
    _oslo_context_parallel = True

    def __init__(self, config: GPT2Config, *, parallel_context=None, submodule: bool = False):
        super().__init__(config, parallel_context=parallel_context)
        self.embed_dim = config.hidden_size
        self.wte = Embedding(config.vocab_size, self.embed_dim)
        self.wpe = Embedding(config.max_position_embeddings, self.embed_dim)
        self.drop = Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([GPT2Block(config, layer_idx=i) for i in range(config.num_hidden_layers)])
        self.ln_f = LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False
        self._warned_sequence_parallel = False
        self.post_init()
        if not submodule:
            self.finish_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, new_embeddings):
        self.wte = new_embeddings

    def _use_sequence_parallel(self, seq_len: int) -> bool:
        """SP needs the sequence to split evenly; otherwise (e.g. one-token decode steps) this call runs plain
        tensor parallelism, which gives the same numbers with more communication."""
        context = self.parallel_context
        if not context.sequence_parallel:
            return False
        if seq_len % context.tp_size == 0:
            return True
        if self.training and not self._warned_sequence_parallel:
            logger.warning("sequence_parallel is on but seq_len=%d is not divisible by tensor_parallel_size=%d; "
                           "running those steps without it", seq_len, context.tp_size)
            self._warned_sequence_parallel = True
        return False

    @can_return_tuple
    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, token_type_ids=None,
                position_ids=None, inputs_embeds=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            input_ids = input_ids.view(-1, input_ids.shape[-1])
            inputs_embeds = self.wte(input_ids)  # vocab-parallel: all-reduce over TP
        batch_size, seq_len = inputs_embeds.shape[:2]
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        cp_mask, position_ids = context_parallel_inputs(self, inputs_embeds, attention_mask, position_ids,
                                                        past_key_values, causal=True)
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(seq_len, device=inputs_embeds.device) + past_seen).unsqueeze(0)
        hidden_states = inputs_embeds + self.wpe(position_ids)
        if token_type_ids is not None:
            hidden_states = hidden_states + self.wte(token_type_ids.view(-1, seq_len))
        causal_mask = cp_mask if cp_mask is not None else create_causal_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            past_key_values=past_key_values, position_ids=position_ids)

        sp = self._use_sequence_parallel(seq_len)
        if sp:
            hidden_states = scatter_to_sequence_parallel_region(hidden_states, self.parallel_context.tp_group)
        hidden_states = self.drop(hidden_states, sequence_parallel=sp)
        outputs = OutputCollector(self, output_attentions, output_hidden_states)
        for block in self.h:
            outputs.hidden(hidden_states, sequence_parallel=sp)
            hidden_states = block(hidden_states, causal_mask, past_key_values, sequence_parallel=sp,
                                  position_ids=position_ids, outputs=outputs if outputs.active else None, **kwargs)
        hidden_states = self.ln_f(hidden_states, sequence_parallel=sp)
        if sp:  # consumers downstream hold full, identical gradients: the backward is a plain split
            hidden_states = gather_from_sequence_parallel_region(hidden_states, self.parallel_context.tp_group,
                                                                 grad_is_partial=False)
        outputs.hidden(hidden_states)  # transformers' last hidden state is the normalized one
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden_states,
                                                         past_key_values=past_key_values if use_cache else None,
                                                         **outputs.result())


class GPT2LMHeadModel(GPT2PreTrainedModel, GenerationMixin):
    """GPT-2 with the LM head tied to ``wte``. Under TP the head is vocab-parallel and the loss is computed on
    the vocab-split logits (``causal_lm_loss``); ``logits`` are gathered to ``[b, s, V]`` for the output unless
    ``gather_logits=False`` (then they are this rank's ``[b, s, V_padded/tp]`` slice)."""

    parallel_plan = GPT2_LM_PLAN
    _oslo_context_parallel = True
    pipeline_adapter = GPT2LMPipelineAdapter  # pipeline_parallel_size > 1: stages, see pipeline_gpt2.py
    hf_twin = transformers.GPT2LMHeadModel
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: GPT2Config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.transformer = GPT2Model(config, parallel_context=self.parallel_context, submodule=True)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()
        self.finish_init()

    def get_output_embeddings(self):
        return self.lm_head

    def get_input_embeddings(self):
        return self.transformer.wte

    @can_return_tuple
    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, token_type_ids=None,
                position_ids=None, inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                gather_logits: bool = True, num_items_in_batch=None, shift_labels=None, skip_logits: bool = False,
                **kwargs):
        outputs = self.transformer(input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, use_cache=use_cache, return_dict=True, **kwargs)
        # logits [b, s, V] (this rank's [b, s, V_padded/tp] with gather_logits=False; None with skip_logits=True:
        # then the loss runs fused and chunked, see common/lm_loss.py). As transformers: shift_labels (pre-shifted
        # targets) only alongside labels.
        loss, logits = causal_lm_head_outputs(self, outputs.last_hidden_state, labels, logits_to_keep=logits_to_keep,
                                              gather_logits=gather_logits, num_items_in_batch=num_items_in_batch,
                                              shift_labels=shift_labels, skip_logits=skip_logits)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits,
                                                 past_key_values=outputs.past_key_values,
                                                 cross_attentions=outputs.cross_attentions, **passed_on(outputs))


class GPT2ForSequenceClassification(GPT2PreTrainedModel):
    """GPT-2 with a replicated ``score`` head on the last non-padding token (as ``transformers``)."""

    parallel_plan = GPT2_HEAD_PLAN
    hf_twin = transformers.GPT2ForSequenceClassification

    def __init__(self, config: GPT2Config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        self.transformer = GPT2Model(config, parallel_context=self.parallel_context, submodule=True)
        self.score = Linear(config.n_embd, self.num_labels, bias=False)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, token_type_ids=None,
                position_ids=None, inputs_embeds=None, labels=None, use_cache=None, **kwargs):
        outputs = self.transformer(input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, use_cache=use_cache, return_dict=True, **kwargs)
        logits = self.score(outputs.last_hidden_state)  # [b, s, num_labels]
        pooled = last_token_logits(logits, input_ids, self.config.pad_token_id)  # rightmost non-pad token
        loss = sequence_classification_loss(pooled, labels, self.config) if labels is not None else None
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled, past_key_values=outputs.past_key_values,
                                                **passed_on(outputs))


class GPT2ForTokenClassification(GPT2PreTrainedModel):
    """GPT-2 with a replicated ``classifier`` on every token: ``logits [b, s, num_labels]``."""

    parallel_plan = GPT2_HEAD_PLAN
    hf_twin = transformers.GPT2ForTokenClassification

    def __init__(self, config: GPT2Config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        self.transformer = GPT2Model(config, parallel_context=self.parallel_context, submodule=True)
        dropout = getattr(config, "classifier_dropout", None)
        if dropout is None:
            dropout = getattr(config, "hidden_dropout", None)
        self.dropout = Dropout(0.1 if dropout is None else dropout)  # transformers' fallback
        self.classifier = Linear(config.hidden_size, config.num_labels)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, token_type_ids=None,
                position_ids=None, inputs_embeds=None, labels=None, use_cache=None, **kwargs):
        outputs = self.transformer(input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, use_cache=use_cache, return_dict=True, **kwargs)
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        return token_classification_output(logits, labels, outputs)


class GPT2ForQuestionAnswering(GPT2PreTrainedModel):
    """GPT-2 with a replicated span head ``qa_outputs``: ``start_logits, end_logits [b, s]``."""

    parallel_plan = GPT2_HEAD_PLAN
    hf_twin = transformers.GPT2ForQuestionAnswering

    def __init__(self, config: GPT2Config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        self.transformer = GPT2Model(config, parallel_context=self.parallel_context, submodule=True)
        self.qa_outputs = Linear(config.hidden_size, 2)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, **kwargs):
        outputs = self.transformer(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                   position_ids=position_ids, inputs_embeds=inputs_embeds, return_dict=True,
                                   **kwargs)
        return question_answering_output(self.qa_outputs(outputs.last_hidden_state), start_positions, end_positions,
                                         outputs)
