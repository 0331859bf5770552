"""RoBERTa: BERT's encoder (imported, not copied) with RoBERTa's position ids and heads.

What differs from BERT, and nothing else, lives here: position ids count non-padding tokens from
``padding_idx + 1`` (padding keeps ``padding_idx``, whose embedding row gets no gradient), the MLM head
``lm_head`` (dense, GELU, ``layer_norm``, vocab-parallel ``decoder`` with a tied ``bias``), and the
classification head on the ``<s>`` token. Shapes and collectives are BERT's (see ``bert/modeling_bert.py``).
"""
from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.activations import gelu
from transformers.modeling_outputs import MaskedLMOutput, SequenceClassifierOutput
from transformers.utils.generic import can_return_tuple

from ...parallel_layers.layers import Dropout, Embedding, LayerNorm, Linear
from ..bert.heads_bert import BertForMultipleChoice, BertLMHeadModel
from ..bert.modeling_bert import (
    BertEmbeddings,
    BertForQuestionAnswering,
    BertForTokenClassification,
    BertModel,
    BertPreTrainedModel,
    _base_kwargs,
)
from ..common.lm_loss import head_loss_and_logits
from ..common.outputs import passed_on
from ..heads import sequence_classification_loss
from .configuration_roberta import RobertaConfig
from .parallel_plan import ROBERTA_BASE_PLAN, ROBERTA_HEAD_PLAN, ROBERTA_MLM_PLAN
from .pipeline_roberta import RobertaMLMPipelineAdapter


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size,
                                             padding_idx=self.padding_idx)

    def make_position_ids(self, input_ids, inputs_embeds, past_length: int) -> torch.Tensor:
        """fairseq's ``make_positions``: ``padding_idx + 1 + (index among non-padding tokens)``, ``padding_idx``
        on padding. Without ``input_ids`` padding cannot be seen, so positions are sequential."""
        if input_ids is None:
            seq_len = inputs_embeds.shape[1]
            positions = torch.arange(self.padding_idx + 1, seq_len + self.padding_idx + 1, device=inputs_embeds.device)
            return positions.unsqueeze(0).expand(inputs_embeds.shape[:2])
        not_pad = input_ids.ne(self.padding_idx).int()
        return ((torch.cumsum(not_pad, dim=1).type_as(not_pad) + past_length) * not_pad).long() + self.padding_idx


class RobertaPreTrainedModel(BertPreTrainedModel):
    config_class = RobertaConfig
    config: RobertaConfig
    base_model_prefix = "roberta"
    _no_split_modules = ["RobertaEmbeddings", "BertLayer"]


class RobertaModel(RobertaPreTrainedModel, BertModel):
    parallel_plan = ROBERTA_BASE_PLAN
    hf_twin = transformers.RobertaModel
    embeddings_class = RobertaEmbeddings


class RobertaLMHead(nn.Module):
    """``decoder(layer_norm(gelu(dense(x))))``; the dense and norm are replicated, the decoder vocab-parallel:
    ``[b, s, h] -> [b, s, V_padded/tp]``."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def features(self, features):
        """The replicated transform before the decoder: ``[b, s, h] -> [b, s, h]``."""
        return self.layer_norm(gelu(self.dense(features)))

    def forward(self, features):
        return self.decoder(self.features(features))


class RobertaForMaskedLM(RobertaPreTrainedModel):
    """RoBERTa with the MLM head; loss on vocab-split logits, ``logits`` gathered unless ``gather_logits=False``."""

    parallel_plan = ROBERTA_MLM_PLAN
    hf_twin = transformers.RobertaForMaskedLM
    pipeline_adapter = RobertaMLMPipelineAdapter  # pipeline_parallel_size > 1: stages, see pipeline_roberta.py
    _decoder_bias_owner = "lm_head"
    _tied_weights_keys = {"lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
                          "lm_head.decoder.bias": "lm_head.bias"}

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.roberta = RobertaModel(config, add_pooling_layer=False, parallel_context=self.parallel_context,
                                    submodule=True)
        self.lm_head = RobertaLMHead(config)
        self.post_init()
        self.finish_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder if self.lm_head is not None else None  # None off a pipeline's last stage

    def get_input_embeddings(self):
        return self.roberta.embeddings.word_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, gather_logits: bool = True, num_items_in_batch=None,
                skip_logits: bool = False, **kwargs):
        outputs = self.roberta(**_base_kwargs(input_ids, attention_mask, token_type_ids, position_ids,
                                              inputs_embeds, kwargs))
        # logits [b, s, V] ([b, s, V_padded/tp] with gather_logits=False; None with skip_logits, see lm_loss.py)
        loss, logits = head_loss_and_logits(self.lm_head.decoder, self.lm_head.features(outputs.last_hidden_state),
                                            labels, causal=False, skip_logits=skip_logits,
                                            fused=self.parallel_context.config.fused_ops, gather_logits=gather_logits,
                                            num_items_in_batch=num_items_in_batch)
        return MaskedLMOutput(loss=loss, logits=logits, **passed_on(outputs))


class RobertaClassificationHead(nn.Module):
    """``out_proj(dropout(tanh(dense(dropout(h[:, 0])))))``, replicated."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = Dropout(dropout)
        self.out_proj = Linear(config.hidden_size, config.num_labels)

    def forward(self, features):
        x = self.dropout(features[:, 0, :])
        x = self.dropout(torch.tanh(self.dense(x)))
        return self.out_proj(x)


class RobertaForSequenceClassification(RobertaPreTrainedModel):
    parallel_plan = ROBERTA_HEAD_PLAN
    hf_twin = transformers.RobertaForSequenceClassification

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        self.roberta = RobertaModel(config, add_pooling_layer=False, parallel_context=self.parallel_context,
                                    submodule=True)
        self.classifier = RobertaClassificationHead(config)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs):
        outputs = self.roberta(**_base_kwargs(input_ids, attention_mask, token_type_ids, position_ids,
                                              inputs_embeds, kwargs))
        logits = self.classifier(outputs.last_hidden_state)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, **passed_on(outputs))


class RobertaForTokenClassification(RobertaPreTrainedModel, BertForTokenClassification):
    """BERT's token classifier on RoBERTa's encoder (``roberta.*`` keys)."""

    parallel_plan = ROBERTA_HEAD_PLAN
    hf_twin = transformers.RobertaForTokenClassification
    base_model_class = RobertaModel


class RobertaForQuestionAnswering(RobertaPreTrainedModel, BertForQuestionAnswering):
    """BERT's span head on RoBERTa's encoder (``roberta.*`` keys)."""

    parallel_plan = ROBERTA_HEAD_PLAN
    hf_twin = transformers.RobertaForQuestionAnswering
    base_model_class = RobertaModel


class RobertaForCausalLM(RobertaPreTrainedModel, BertLMHeadModel):
    """BERT's causal-LM head model on RoBERTa's encoder and ``lm_head`` (``config.is_decoder``)."""

    parallel_plan = ROBERTA_MLM_PLAN
    hf_twin = transformers.RobertaForCausalLM
    base_model_class = RobertaModel
    head_name, head_class = "lm_head", RobertaLMHead
    _decoder_bias_owner = "lm_head"
    _tied_weights_keys = RobertaForMaskedLM._tied_weights_keys


class RobertaForMultipleChoice(RobertaPreTrainedModel, BertForMultipleChoice):
    """BERT's multiple-choice head on RoBERTa's encoder (``roberta.*`` keys; dropout ``hidden_dropout_prob``)."""

    parallel_plan = ROBERTA_HEAD_PLAN
    hf_twin = transformers.RobertaForMultipleChoice
    base_model_class = RobertaModel

    @staticmethod
    def classifier_dropout(config) -> float:
        return config.hidden_dropout_prob
