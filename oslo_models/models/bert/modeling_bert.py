"""BERT, written single-device with the module tree and state-dict keys of ``transformers``' BERT.

Parallelism enters through the layers the plan (``parallel_plan.py``) swaps in and through two explicit
sequence-parallel boundaries in ``BertModel.forward``: after the embeddings (sum, LayerNorm, dropout: cheap and
replicated) the residual stream is scattered along the sequence (``[b, s, h] -> [b, s/tp, h]``) and after the
last layer it is gathered back, so pooler, heads and every public tensor see HF's ``[batch, seq, hidden]``.
The q/k/v projections are three column-parallel layers (as in the checkpoint), so under sequence parallelism
each gathers the sequence on its own: three all-gathers forward, three reduce-scatters backward per layer.

Shapes: b batch, s sequence, h hidden, n heads (n/tp per rank), d head dim, V vocabulary.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    MaskedLMOutput,
    SequenceClassifierOutput,
)
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput, eager_attention_forward
from transformers.utils.generic import can_return_tuple

from ...config import ParallelConfig
from ...parallel_layers.layers import Dropout, Embedding, LayerNorm, Linear
from ..common.context_parallel import context_parallel_inputs, context_parallel_loss, context_parallel_loss_items
from ..common.bias_act import fused_gelu_approximation, linear_act
from ..common.lm_loss import head_loss_and_logits
from ..common import attend, enter_sequence_parallel, full_logits, leave_sequence_parallel, split_heads, token_loss
from ..common import use_sequence_parallel
from ..common.attention import AttentionModule
from ..common.legacy_keys import LegacyKeyReader
from ..common.outputs import OutputCollector, passed_on
from ..heads import question_answering_output, sequence_classification_loss, token_classification_output
from ..modeling_utils import OsloPreTrainedModel
from .configuration_bert import BertConfig
from .parallel_plan import BERT_BASE_PLAN, BERT_HEAD_PLAN, BERT_MLM_PLAN
from .pipeline_bert import BertMLMPipelineAdapter, BertSequenceClassificationPipelineAdapter


def _activation(hidden_act):
    return ACT2FN[hidden_act] if isinstance(hidden_act, str) else hidden_act


class BertEmbeddings(nn.Module):
    """word + position + token-type embeddings, LayerNorm, dropout: ``[b, s]`` ids -> ``[b, s, h]``.

    The word embeddings are vocab-parallel (one all-reduce); everything else is replicated. Position ids are
    ``past_length .. past_length + s - 1`` unless given (RoBERTa overrides ``make_position_ids``).
    """

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def make_position_ids(self, input_ids, inputs_embeds, past_length: int) -> torch.Tensor:
        seq_len = inputs_embeds.shape[1]
        return (torch.arange(seq_len, device=inputs_embeds.device) + past_length).unsqueeze(0)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                past_key_values_length: int = 0) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # vocab-parallel: all-reduce over TP
        if position_ids is None:
            position_ids = self.make_position_ids(input_ids, inputs_embeds, past_key_values_length)
        if token_type_ids is None:
            token_type_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(AttentionModule):
    """Attention on this rank's heads: input ``[b, s(/tp), h]``, output ``[b, s, (n/tp)*d]``. Bidirectional, or
    causal with a key/value cache when ``config.is_decoder`` (``BertLMHeadModel``, ``RobertaForCausalLM``)."""

    def __init__(self, config, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = self.attention_head_size ** -0.5
        self.is_causal = bool(config.is_decoder)
        self.query = Linear(config.hidden_size, self.all_head_size)
        self.key = Linear(config.hidden_size, self.all_head_size)
        self.value = Linear(config.hidden_size, self.all_head_size)
        self.dropout = Dropout(config.attention_probs_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, *, sequence_parallel=False, outputs=None,
                past_key_values=None, **kwargs):
        query, key, value = (split_heads(proj(hidden_states, sequence_parallel=sequence_parallel),
                                         self.attention_head_size) for proj in (self.query, self.key, self.value))
        if past_key_values is not None:  # decoder: this rank's heads of the cache
            key, value = past_key_values.update(key, value, self.layer_idx)
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.dropout, scaling=self.scaling,
                              eager_fallback=eager_attention_forward, **kwargs)
        if outputs is not None:
            outputs.attention(weights)  # [b, n/tp, s, s] -> all heads
        return out, weights


class BertSelfOutput(nn.Module):
    """Row-parallel ``dense`` (all-reduce, or reduce-scatter under SP), dropout, post-LN residual."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor, *, sequence_parallel=False):
        sp = sequence_parallel
        hidden_states = self.dropout(self.dense(hidden_states, sequence_parallel=sp), sequence_parallel=sp)
        return self.LayerNorm(hidden_states + input_tensor, sequence_parallel=sp)


class BertAttention(nn.Module):
    def __init__(self, config, layer_idx: int | None = None):
        super().__init__()
        self.self = BertSelfAttention(config, layer_idx)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, *, sequence_parallel=False, **kwargs):
        attention_output, _ = self.self(hidden_states, attention_mask, sequence_parallel=sequence_parallel, **kwargs)
        return self.output(attention_output, hidden_states, sequence_parallel=sequence_parallel)


class BertIntermediate(nn.Module):
    """Column-parallel ``dense`` + activation: ``[b, s(/tp), h] -> [b, s, i/tp]``."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        self.hidden_act = config.hidden_act if isinstance(config.hidden_act, str) else None
        self.intermediate_act_fn = _activation(config.hidden_act)
        self.fused_gelu = None  # bias_gelu's ``approximate`` when the fused bias-GELU runs (configure_fused_ops)

    def configure_fused_ops(self, enabled: bool) -> None:
        self.fused_gelu = fused_gelu_approximation(enabled, self.hidden_act, self.dense)

    def forward(self, hidden_states, *, sequence_parallel=False):
        return linear_act(self.dense, self.intermediate_act_fn, hidden_states, approximate=self.fused_gelu,
                          sequence_parallel=sequence_parallel)


class BertOutput(BertSelfOutput):
    """Row-parallel ``dense`` from the intermediate size back to ``h``, dropout, post-LN residual."""

    def __init__(self, config):
        super().__init__(config)
        self.dense = Linear(config.intermediate_size, config.hidden_size)


class BertLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx: int | None = None):
        super().__init__()
        self.attention = BertAttention(config, layer_idx)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states, attention_mask=None, *, sequence_parallel=False, **kwargs):
        sp = sequence_parallel
        attention_output = self.attention(hidden_states, attention_mask, sequence_parallel=sp, **kwargs)
        intermediate = self.intermediate(attention_output, sequence_parallel=sp)
        return self.output(intermediate, attention_output, sequence_parallel=sp)


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config, layer_idx=i) for i in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None, *, sequence_parallel=False, outputs=None, **kwargs):
        for layer in self.layer:
            if outputs is not None:
                outputs.hidden(hidden_states, sequence_parallel=sequence_parallel)
            hidden_states = layer(hidden_states, attention_mask, sequence_parallel=sequence_parallel,
                                  outputs=outputs, **kwargs)
        return hidden_states


class BertPooler(nn.Module):
    """``tanh(dense(h[:, 0]))``, replicated."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        return self.activation(self.dense(hidden_states[:, 0]))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = _activation(config.hidden_act)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    """Replicated transform, then the vocab-parallel ``decoder`` (weight tied to the word embeddings, bias tied
    to this module's ``bias``): ``[b, s, h] -> [b, s, V_padded/tp]``."""

    def __init__(self, config):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = Linear(config.hidden_size, config.vocab_size, bias=True)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def features(self, hidden_states):
        """The replicated transform before the decoder: ``[b, s, h] -> [b, s, h]``."""
        return self.transform(hidden_states)

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)

    def features(self, sequence_output):
        return self.predictions.features(sequence_output)

    def forward(self, sequence_output):
        return self.predictions(sequence_output)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = Linear(config.hidden_size, 2)

    def forward(self, sequence_output, pooled_output):
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


class BertPreTrainedModel(OsloPreTrainedModel):
    config_class = BertConfig
    config: BertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BertEmbeddings", "BertLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _decoder_bias_owner: ClassVar[str | None] = None  # the MLM head module whose ``bias`` the decoder shares

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        tp = parallel.tensor_parallel_size
        name = type(config).__name__.replace("Config", "")
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"{name} hidden_size={config.hidden_size} is not divisible by num_attention_heads="
                             f"{config.num_attention_heads}")
        if config.num_attention_heads % tp:
            raise ValueError(f"{name} num_attention_heads={config.num_attention_heads} is not divisible by "
                             f"tensor_parallel_size={tp}")
        if config.intermediate_size % tp:
            raise ValueError(f"{name} intermediate_size={config.intermediate_size} is not divisible by "
                             f"tensor_parallel_size={tp}")
        if config.add_cross_attention:
            raise NotImplementedError(f"{name} with cross-attention (add_cross_attention) is not implemented")

    def load_from_reader(self, reader, *, progress: bool = False, **options):
        # LayerNorm.gamma/beta keys of old checkpoints
        return super().load_from_reader(LegacyKeyReader.wrap(reader), progress=progress, **options)

    def set_output_embeddings(self, new_embeddings) -> None:
        """The new decoder, and (as ``transformers``) the head's own ``bias`` becomes the decoder's bias."""
        super().set_output_embeddings(new_embeddings)
        head = dict(self.named_modules()).get(self._decoder_bias_owner) if self._decoder_bias_owner else None
        if head is not None:
            head.bias = new_embeddings.bias
            head.vocab_size = getattr(new_embeddings, "vocab_size", new_embeddings.out_features)

    def tie_parallel_weights(self) -> None:
        """Tie the decoder weight to the word embeddings and, as ``transformers`` does, the decoder bias to the
        head's own ``bias`` (both only when ``tie_word_embeddings``)."""
        super().tie_parallel_weights()
        if self._decoder_bias_owner and getattr(self.config, "tie_word_embeddings", False):
            head = dict(self.named_modules()).get(self._decoder_bias_owner)  # None off a pipeline's last stage
            if head is not None:
                head.decoder.bias = head.bias


class BertModel(BertPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` layers, optional pooler. ``last_hidden_state``: ``[b, s, h]``;
    ``pooler_output``: ``[b, h]``."""

    parallel_plan = BERT_BASE_PLAN
    hf_twin = transformers.BertModel
    _oslo_context_parallel = True
    embeddings_class: ClassVar[type] = BertEmbeddings

    def __init__(self, config, add_pooling_layer: bool = True, *, parallel_context=None, submodule: bool = False):
        super().__init__(config, parallel_context=parallel_context)
        self.embeddings = self.embeddings_class(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.gradient_checkpointing = False
        self.post_init()
        if not submodule:
            self.finish_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, output_attentions=None, output_hidden_states=None, past_key_values=None,
                use_cache=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        use_cache = (use_cache if use_cache is not None else self.config.use_cache) and self.config.is_decoder
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        cp_mask, position_ids = context_parallel_inputs(  # RoBERTa's positions need the whole sequence
            self, input_ids if input_ids is not None else inputs_embeds, attention_mask, position_ids,
            past_key_values, causal=bool(self.config.is_decoder),
            default_positions=type(self.embeddings).make_position_ids is BertEmbeddings.make_position_ids)
        if cp_mask is not None and self.pooler is not None:
            raise NotImplementedError("the [CLS] pooler under context parallelism is not implemented (only cp rank "
                                      "0 holds the first token); build the model with add_pooling_layer=False")
        hidden_states = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids,
                                        position_ids=position_ids, inputs_embeds=inputs_embeds,
                                        past_key_values_length=past_length)
        if cp_mask is not None:
            mask = cp_mask
        elif self.config.is_decoder:
            mask = create_causal_mask(config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask,
                                      past_key_values=past_key_values)
            kwargs["past_key_values"] = past_key_values
        else:
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden_states,
                                             attention_mask=attention_mask)
        sp = use_sequence_parallel(self, hidden_states.shape[1])
        if sp:
            hidden_states = enter_sequence_parallel(hidden_states, self.parallel_context)
        outputs = OutputCollector(self, output_attentions, output_hidden_states)
        hidden_states = self.encoder(hidden_states, mask, sequence_parallel=sp,
                                     outputs=outputs if outputs.active else None, **kwargs)
        if sp:
            hidden_states = leave_sequence_parallel(hidden_states, self.parallel_context)
        outputs.hidden(hidden_states)
        pooled = self.pooler(hidden_states) if self.pooler is not None else None
        return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=hidden_states, pooler_output=pooled,
                                                            past_key_values=past_key_values if use_cache else None,
                                                            **outputs.result())


def _base_kwargs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs) -> dict:
    """The base model's arguments from a head's; the base always answers with its output object."""
    kwargs.pop("return_dict", None)
    return dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                position_ids=position_ids, inputs_embeds=inputs_embeds, return_dict=True, **kwargs)


class BertForMaskedLM(BertPreTrainedModel):
    """BERT with the MLM head. The decoder is vocab-parallel and the loss runs on the vocab-split logits;
    ``logits`` are gathered to ``[b, s, V]`` unless ``gather_logits=False`` (then ``[b, s, V_padded/tp]``)."""

    parallel_plan = BERT_MLM_PLAN
    hf_twin = transformers.BertForMaskedLM
    _oslo_context_parallel = True
    pipeline_adapter = BertMLMPipelineAdapter  # pipeline_parallel_size > 1: stages, see pipeline_bert.py
    _decoder_bias_owner = "cls.predictions"
    _tied_weights_keys = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                          "cls.predictions.decoder.bias": "cls.predictions.bias"}

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.bert = BertModel(config, add_pooling_layer=False, parallel_context=self.parallel_context,
                              submodule=True)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()
        self.finish_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder if self.cls is not None else None  # None off a pipeline's last stage

    def get_input_embeddings(self):
        return self.bert.embeddings.word_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, gather_logits: bool = True, num_items_in_batch=None,
                skip_logits: bool = False, **kwargs):
        outputs = self.bert(**_base_kwargs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                           kwargs))
        # logits [b, s, V] ([b, s, V_padded/tp] with gather_logits=False; None with skip_logits, see lm_loss.py)
        if labels is not None:
            num_items_in_batch = context_parallel_loss_items(self, labels, num_items_in_batch, causal=False)
        loss, logits = head_loss_and_logits(self.cls.predictions.decoder, self.cls.features(outputs.last_hidden_state),
                                            labels, causal=False, skip_logits=skip_logits,
                                            fused=self.parallel_context.config.fused_ops, gather_logits=gather_logits,
                                            num_items_in_batch=num_items_in_batch)
        loss = context_parallel_loss(self, loss)  # cp: the mean over the whole sequence
        return MaskedLMOutput(loss=loss, logits=logits, **passed_on(outputs))


class BertForPreTraining(BertPreTrainedModel):
    """MLM head (vocab-parallel, as ``BertForMaskedLM``) plus the replicated next-sentence head on the pooler.
    The loss is MLM + NSP when both ``labels`` and ``next_sentence_label`` are given."""

    parallel_plan = BERT_MLM_PLAN
    hf_twin = transformers.BertForPreTraining
    _decoder_bias_owner = "cls.predictions"
    _tied_weights_keys = BertForMaskedLM._tied_weights_keys

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.bert = BertModel(config, parallel_context=self.parallel_context, submodule=True)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()
        self.finish_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def get_input_embeddings(self):
        return self.bert.embeddings.word_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, next_sentence_label=None, gather_logits: bool = True, **kwargs):
        outputs = self.bert(**_base_kwargs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                           kwargs))
        local_logits, seq_relationship = self.cls(outputs.last_hidden_state, outputs.pooler_output)
        decoder = self.cls.predictions.decoder
        loss = None
        if labels is not None and next_sentence_label is not None:
            loss = token_loss(local_logits, labels, decoder) + F.cross_entropy(
                seq_relationship.view(-1, 2), next_sentence_label.view(-1))
        return BertForPreTrainingOutput(loss=loss, prediction_logits=full_logits(local_logits, decoder, gather_logits),
                                        seq_relationship_logits=seq_relationship, **passed_on(outputs))


class BertForSequenceClassification(BertPreTrainedModel):
    """Replicated ``classifier`` on the pooled ``[CLS]`` state: ``logits [b, num_labels]``."""

    parallel_plan = BERT_HEAD_PLAN
    hf_twin = transformers.BertForSequenceClassification
    pipeline_adapter = BertSequenceClassificationPipelineAdapter  # see pipeline_bert.py

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, parallel_context=self.parallel_context, submodule=True)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = Dropout(dropout)
        self.classifier = Linear(config.hidden_size, config.num_labels)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs):
        outputs = self.bert(**_base_kwargs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                           kwargs))
        logits = self.classifier(self.dropout(outputs.pooler_output))
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, **passed_on(outputs))


class BertForTokenClassification(BertPreTrainedModel):
    """Replicated ``classifier`` on every token: ``logits [b, s, num_labels]``.

    The encoder is ``base_model_class`` registered under ``base_model_prefix``, so RoBERTa reuses this class
    with its own encoder and keys (``roberta.*``)."""

    parallel_plan = BERT_HEAD_PLAN
    hf_twin = transformers.BertForTokenClassification
    base_model_class = BertModel

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        setattr(self, self.base_model_prefix, self.base_model_class(
            config, add_pooling_layer=False, parallel_context=self.parallel_context, submodule=True))
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = Dropout(dropout)
        self.classifier = Linear(config.hidden_size, config.num_labels)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs):
        outputs = self.base_model(**_base_kwargs(input_ids, attention_mask, token_type_ids, position_ids,
                                                 inputs_embeds, kwargs))
        return token_classification_output(self.classifier(self.dropout(outputs.last_hidden_state)), labels, outputs)


class BertForQuestionAnswering(BertPreTrainedModel):
    """Replicated ``qa_outputs``: ``start_logits, end_logits [b, s]``. Encoder as in the token classifier."""

    parallel_plan = BERT_HEAD_PLAN
    hf_twin = transformers.BertForQuestionAnswering
    base_model_class = BertModel

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        setattr(self, self.base_model_prefix, self.base_model_class(
            config, add_pooling_layer=False, parallel_context=self.parallel_context, submodule=True))
        self.qa_outputs = Linear(config.hidden_size, config.num_labels)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, **kwargs):
        outputs = self.base_model(**_base_kwargs(input_ids, attention_mask, token_type_ids, position_ids,
                                                 inputs_embeds, kwargs))
        return question_answering_output(self.qa_outputs(outputs.last_hidden_state), start_positions, end_positions,
                                         outputs)
