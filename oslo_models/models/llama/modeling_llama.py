"""The Llama-shaped decoder, written once, single-device, with the module tree and state-dict keys of
``transformers``' Llama; Mistral, Qwen2 and Qwen3 are the same code with other switches (``decoder_options``) and
their own class names (``models/mistral``, ``models/qwen2``, ``models/qwen3``).

What differs between the four, and where it is decided:

- attention biases (Llama ``attention_bias``/``mlp_bias``, Qwen2 q/k/v biases, Qwen3 ``attention_bias``) and
  Qwen3's q/k RMS norms: ``decoder_options(config)``, a class method each family overrides;
- sliding-window attention (Mistral ``sliding_window``, Qwen2/Qwen3 ``use_sliding_window``/``max_window_layers``,
  or ``layer_types``): ``attention_types(config)`` (``common.causal_masks.layer_types``; Mistral overrides it);
- the feed-forward: ``build_mlp(config, layer_idx)`` (SwiGLU here; the hook mixture-of-experts decoders override);
- tied or untied embeddings: ``config.tie_word_embeddings``.

Parallelism enters only through the layers the plan (``parallel_plan.py``) swaps in and the two explicit
sequence-parallel boundaries in ``LlamaModel.forward`` (after the embeddings the residual stream is split along the
sequence, after the final norm it is gathered back), so every public tensor keeps HF's ``[batch, seq, hidden]``.

Shapes: b batch, s sequence, h hidden, n query heads (n/tp per rank), n_kv key/value heads, d head dim, V vocab.
"""
from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.utils.generic import can_return_tuple

from ...config import ParallelConfig
from ...parallel_layers.kv_heads import check_grid_heads
from ...parallel_layers.layers import Dropout, Embedding, Linear
from ..common import (
    GatedMLP,
    GroupedQueryAttention,
    RMSNorm,
    RotaryEmbedding,
    causal_masks,
    enter_sequence_parallel,
    layer_types,
    leave_sequence_parallel,
    use_sequence_parallel,
)
from ..common.causal_masks import FULL, SLIDING
from ..common.context_parallel import causal_lm_head_outputs, context_parallel_inputs
from ..common.outputs import OutputCollector, passed_on
from ..heads import (
    last_token_logits,
    question_answering_output,
    sequence_classification_loss,
    token_classification_output,
)
from ..modeling_utils import OsloPreTrainedModel
from .configuration_llama import LlamaConfig
from .parallel_plan import LLAMA_BASE_PLAN, LLAMA_HEAD_PLAN, LLAMA_LM_PLAN, LLAMA_QA_PLAN
from .pipeline_llama import LlamaPipelineAdapter


class LlamaDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``. ``attention_type`` (full or sliding)
    picks this layer's mask from the stack's ``{type: mask}``; ``mlp`` is the family's feed-forward (``build_mlp``:
    the SwiGLU ``GatedMLP`` here, a mixture-of-experts block in the MoE decoders), called as
    ``mlp(x, sequence_parallel=...)``."""

    def __init__(self, config, layer_idx: int, *, options: dict, attention_type: str, mlp: nn.Module,
                 fused: bool = False):
        super().__init__()
        self.attention_type = attention_type
        window = config.sliding_window if attention_type == SLIDING else None
        self.self_attn = GroupedQueryAttention(config, layer_idx, qkv_bias=options["qkv_bias"],
                                               o_bias=options["o_bias"], qk_norm=options["qk_norm"],
                                               sliding_window=window, fused=fused)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, formula="llama", fused=fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, formula="llama",
                                                fused=fused)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, *,
                sequence_parallel: bool = False, outputs: OutputCollector | None = None, **kwargs):
        sp = sequence_parallel
        attn_output, weights = self.self_attn(self.input_layernorm(hidden_states, sequence_parallel=sp),
                                              position_embeddings, attention_mask, past_key_values,
                                              sequence_parallel=sp, **kwargs)
        if outputs is not None:
            outputs.attention(weights)  # [b, n/tp, s, s_k] -> all heads
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states, sequence_parallel=sp),
                                        sequence_parallel=sp)


class LlamaPreTrainedModel(OsloPreTrainedModel):
    config_class = LlamaConfig
    config: LlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _keys_to_ignore_on_load_unexpected = ["rotary_emb.inv_freq"]  # persisted by some old Llama conversions
    # 3D tensor parallelism: position ids feed only the rotary attention, which runs in the inner layout
    grid_inner_inputs = ("attention_mask", "position_ids")

    @classmethod
    def decoder_options(cls, config) -> dict:
        """The switches of this family's decoder (Llama: ``attention_bias`` on q/k/v/o, ``mlp_bias``)."""
        bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm=False)

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        tp, name = parallel.tensor_parallel_size, config.model_type
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % kv_heads:
            raise ValueError(f"{name}: num_attention_heads={heads} is not a multiple of num_key_value_heads="
                             f"{kv_heads}")
        if parallel.tensor_parallel_mode != "1d":  # 2D/2.5D/3D: heads and FFN split over the grid's q blocks
            check_grid_heads(heads, parallel)
            check_grid_heads(kv_heads, parallel, f"{name}: num_key_value_heads")
            q = parallel.grid_shape[-1]
            if config.intermediate_size % q:
                raise ValueError(f"{name}: intermediate_size={config.intermediate_size} is not divisible by the "
                                 f"grid's q={q}")
            return
        if heads % tp:
            raise ValueError(f"{name}: num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}")
        if tp <= kv_heads and kv_heads % tp:
            raise ValueError(f"{name}: num_key_value_heads={kv_heads} is not divisible by tensor_parallel_size={tp}")
        if tp > kv_heads and tp % kv_heads:
            raise ValueError(f"{name}: tensor_parallel_size={tp} exceeds num_key_value_heads={kv_heads} but is not a "
                             f"multiple of it, so the key/value heads cannot be replicated evenly")
        if config.intermediate_size % tp:
            raise ValueError(f"{name}: intermediate_size={config.intermediate_size} is not divisible by "
                             f"tensor_parallel_size={tp}")

    @classmethod
    def attention_types(cls, config) -> list[str]:
        """Each layer's ``"full_attention"`` / ``"sliding_attention"`` (``common.causal_masks.layer_types``)."""
        return layer_types(config)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward, registered as ``mlp`` (the hook the MoE decoders override)."""
        return GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act,
                        bias=cls.decoder_options(config)["mlp_bias"])

    def _build_layer(self, layer_idx: int) -> LlamaDecoderLayer:
        config = self.config
        return self.decoder_layer_class(config, layer_idx, options=self.decoder_options(config),
                                 attention_type=self.attention_types(config)[layer_idx],
                                 mlp=self.build_mlp(config, layer_idx), fused=self.parallel_context.config.fused_ops)


class LlamaModel(LlamaPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` decoder layers, the final norm and the rotary embedding.
    Output ``last_hidden_state``: ``[b, s, h]``."""

    parallel_plan = LLAMA_BASE_PLAN
    hf_twin = transformers.LlamaModel
    _oslo_context_parallel = True
    decoder_layer_class = LlamaDecoderLayer  # the MoE decoders (models/mixtral, qwen2_moe) swap in theirs

    def __init__(self, config, *, parallel_context=None, submodule: bool = False):
        super().__init__(config, parallel_context=parallel_context)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([self._build_layer(i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, formula="llama",
                            fused=self.parallel_context.config.fused_ops)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()
        if not submodule:
            self.finish_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                **kwargs) -> BaseModelOutputWithPast:
        """``output_attentions`` / ``output_hidden_states``: gathered over the TP heads / SP chunks to what
        ``transformers`` returns, on every rank (``common/outputs.py``; attentions need the eager kernel)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # vocab-parallel: all-reduce over TP
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        cp_mask, position_ids = context_parallel_inputs(self, inputs_embeds, attention_mask, position_ids,
                                                        past_key_values, causal=True)
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen)[None]
        if cp_mask is not None:  # one mask for every layer kind: each layer passes its own sliding window
            masks = {FULL: cp_mask, SLIDING: cp_mask}
        else:
            masks = causal_masks(self.config, inputs_embeds, attention_mask, past_key_values, position_ids,
                                 kinds={layer.attention_type for layer in self.layers})
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)  # full sequence on every rank

        sp = use_sequence_parallel(self, inputs_embeds.shape[1])
        if sp:
            hidden_states = enter_sequence_parallel(hidden_states, self.parallel_context)
        outputs = OutputCollector(self, output_attentions, output_hidden_states)
        for layer in self.layers:
            outputs.hidden(hidden_states, sequence_parallel=sp)
            hidden_states = layer(hidden_states, masks[layer.attention_type], position_embeddings, past_key_values,
                                  sequence_parallel=sp, position_ids=position_ids,
                                  outputs=outputs if outputs.active else None, **kwargs)
        hidden_states = self.norm(hidden_states, sequence_parallel=sp)
        if sp:
            hidden_states = leave_sequence_parallel(hidden_states, self.parallel_context)
        outputs.hidden(hidden_states)  # transformers' last hidden state is the normalized one
        collected = outputs.result()  # a decoder-only stack: no cross-attentions
        return BaseModelOutputWithPast(last_hidden_state=hidden_states,
                                       past_key_values=past_key_values if use_cache else None,
                                       hidden_states=collected["hidden_states"], attentions=collected["attentions"])


class _WithBaseModel(LlamaPreTrainedModel):
    """A head on ``base_model_class`` registered under ``base_model_prefix`` (``model``; Llama's QA head:
    ``transformer``), as ``transformers``' generic heads do."""

    base_model_class = LlamaModel

    def _build_base(self):
        setattr(self, self.base_model_prefix, self.base_model_class(self.config, parallel_context=self.parallel_context,
                                                                    submodule=True))

    def get_input_embeddings(self):
        return self.base_model.embed_tokens

    def _base_outputs(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache,
                      kwargs) -> BaseModelOutputWithPast:
        kwargs.pop("return_dict", None)  # the head decides (``can_return_tuple``); the base answers a dict
        return self.base_model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                               return_dict=True, **kwargs)


class LlamaForCausalLM(_WithBaseModel, GenerationMixin):
    """The decoder with an LM head (tied to ``embed_tokens`` when ``tie_word_embeddings``). Under TP the head is
    vocab-parallel and the loss runs on the vocab-split logits (``causal_lm_loss``); ``logits`` are gathered to
    ``[b, s, V]`` unless ``gather_logits=False`` (then this rank's ``[b, s, V_padded/tp]``)."""

    parallel_plan = LLAMA_LM_PLAN
    _oslo_context_parallel = True
    pipeline_adapter = LlamaPipelineAdapter  # pipeline_parallel_size > 1: stages, see pipeline_llama.py
    hf_twin = transformers.LlamaForCausalLM
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self._build_base()
        self.vocab_size = config.vocab_size
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.finish_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, gather_logits: bool = True,
                num_items_in_batch=None, shift_labels=None, skip_logits: bool = False,
                **kwargs) -> CausalLMOutputWithPast:
        outputs = self._base_outputs(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                     use_cache, kwargs)
        loss, logits = causal_lm_head_outputs(self, outputs.last_hidden_state, labels, logits_to_keep=logits_to_keep,
                                              gather_logits=gather_logits, num_items_in_batch=num_items_in_batch,
                                              shift_labels=shift_labels, skip_logits=skip_logits)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      **passed_on(outputs))


class LlamaForSequenceClassification(_WithBaseModel):
    """Replicated ``score`` read at each row's last non-padding token (as ``transformers``): ``[b, num_labels]``."""

    parallel_plan = LLAMA_HEAD_PLAN
    hf_twin = transformers.LlamaForSequenceClassification

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        self._build_base()
        self.score = Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, **kwargs) -> SequenceClassifierOutputWithPast:
        outputs = self._base_outputs(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                     use_cache, kwargs)
        logits = last_token_logits(self.score(outputs.last_hidden_state), input_ids, self.config.pad_token_id)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return SequenceClassifierOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                                **passed_on(outputs))


class LlamaForTokenClassification(_WithBaseModel):
    """Replicated ``score`` (after ``dropout``) on every token: ``logits [b, s, num_labels]``."""

    parallel_plan = LLAMA_HEAD_PLAN
    hf_twin = transformers.LlamaForTokenClassification

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        self._build_base()
        dropout = next((value for value in (getattr(config, "classifier_dropout", None),
                                            getattr(config, "hidden_dropout", None)) if value is not None), 0.1)
        self.dropout = Dropout(dropout)
        self.score = Linear(config.hidden_size, config.num_labels,
                            bias=getattr(config, "token_classification_bias", True))
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, **kwargs):
        outputs = self._base_outputs(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                     use_cache, kwargs)
        return token_classification_output(self.score(self.dropout(outputs.last_hidden_state)), labels, outputs)


class LlamaForQuestionAnswering(_WithBaseModel):
    """Replicated ``qa_outputs``: ``start_logits, end_logits [b, s]``. Llama, Qwen2 and Qwen3 keep this head's
    base model under ``transformer`` (``transformers``' backward-compatible name); Mistral under ``model``."""

    parallel_plan = LLAMA_QA_PLAN
    hf_twin = transformers.LlamaForQuestionAnswering
    base_model_prefix = "transformer"

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self._build_base()
        self.qa_outputs = Linear(config.hidden_size, 2)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, start_positions=None, end_positions=None, **kwargs):
        outputs = self._base_outputs(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                     False, kwargs)
        return question_answering_output(self.qa_outputs(outputs.last_hidden_state), start_positions, end_positions,
                                         outputs)
