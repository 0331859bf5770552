"""RoBERTa: BERT's encoder (imported, not copied) with RoBERTa's position ids and heads.

What differs from BERT, and nothing else, lives here: position ids count non-padding tokens from
``padding_idx + 1`` (padding keeps ``padding_idx``, whose embedding row gets no gradient), the MLM head
``lm_head`` (dense, GELU, ``layer_norm``, vocab-parallel ``decoder`` with a tied ``bias``), the classification head
on the ``<s>`` token (``classifier.dense/out_proj``) and the multiple-choice dropout. The heads are the generic
encoder heads (``models/encoder_heads.py``); stack, plan, shapes and collectives are BERT's (see
``bert/modeling_bert.py``).
"""
from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.activations import gelu

from ...parallel_layers.head_parallel import VocabBias
from ...parallel_layers.layers import Dropout, Embedding, LayerNorm, Linear
from ...parallel_layers.plan import Colwise, SequenceParallelNorm, StreamLinear
from ..bert.modeling_bert import BertEmbeddings, BertModel, BertPooler, BertPreTrainedModel, encoder_spec
from ..common.rules.capabilities import Capabilities
from ..encoder_heads import (
    EncoderForCausalLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    ForMaskedLM,
    ForMultipleChoice,
    classifier_dropout,
)
from .configuration_roberta import RobertaConfig


class RobertaEmbeddings(BertEmbeddings):
    derives_positions = True

    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size,
                                             padding_idx=self.padding_idx)

    @classmethod
    def first_position(cls, config) -> int:
        return config.pad_token_id + 1

    def make_position_ids(self, input_ids, inputs_embeds, past_length: int) -> torch.Tensor:
        """fairseq's ``make_positions``: ``padding_idx + 1 + (index among non-padding tokens)``, ``padding_idx``
        on padding. Without ``input_ids`` padding cannot be seen, so positions are sequential."""
        if input_ids is None:
            seq_len = inputs_embeds.shape[1]
            positions = torch.arange(self.padding_idx + 1, seq_len + self.padding_idx + 1, device=inputs_embeds.device)
            return positions.unsqueeze(0).expand(inputs_embeds.shape[:2])
        not_pad = input_ids.ne(self.padding_idx).int()
        return ((torch.cumsum(not_pad, dim=1).type_as(not_pad) + past_length) * not_pad).long() + self.padding_idx


#: BERT's spec over RoBERTa's embeddings
ROBERTA_SPEC = encoder_spec(RobertaEmbeddings, pooler=BertPooler)


class RobertaPreTrainedModel(BertPreTrainedModel):
    config_class = RobertaConfig
    config: RobertaConfig
    base_model_prefix = "roberta"
    stack_spec = ROBERTA_SPEC


class RobertaModel(RobertaPreTrainedModel, BertModel):
    hf_twin = transformers.RobertaModel


RobertaPreTrainedModel.base_model_class = RobertaModel


class RobertaLMHead(nn.Module):
    """``decoder(layer_norm(gelu(dense(x))))``; the dense and norm are replicated (grid layers under 2D/2.5D/3D, as
    BERT's transform), the decoder vocab-parallel: ``[b, s, h] -> [b, s, V_padded/tp]``."""

    tp_plan = {"": VocabBias(), "decoder": Colwise(vocab=True), "dense": StreamLinear(),
               "layer_norm": SequenceParallelNorm()}

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


class RobertaClassificationHead(nn.Module):
    """``out_proj(dropout(tanh(dense(dropout(h[:, 0])))))``, replicated."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.dropout = Dropout(classifier_dropout(config))
        self.out_proj = Linear(config.hidden_size, config.num_labels)

    def forward(self, features):
        x = self.dropout(features[:, 0, :])
        x = self.dropout(torch.tanh(self.dense(x)))
        return self.out_proj(x)


class RobertaForMaskedLM(ForMaskedLM, RobertaPreTrainedModel):
    """RoBERTa with the MLM head ``lm_head`` (see ``ForMaskedLM``); pipeline stages as BERT's."""

    hf_twin = transformers.RobertaForMaskedLM
    head_name, head_class = "lm_head", RobertaLMHead
    _decoder_bias_owner = "lm_head"
    capabilities = Capabilities(context_parallel=True)  # with position_ids given (RobertaModel.stack_inputs says why)


class RobertaForCausalLM(EncoderForCausalLM, RobertaPreTrainedModel):
    """RoBERTa as a causal decoder (``config.is_decoder``) over ``lm_head`` (see ``EncoderForCausalLM``)."""

    hf_twin = transformers.RobertaForCausalLM
    head_name, head_class = "lm_head", RobertaLMHead
    _decoder_bias_owner = "lm_head"


class RobertaForSequenceClassification(EncoderForSequenceClassification, RobertaPreTrainedModel):
    hf_twin = transformers.RobertaForSequenceClassification
    head_class = RobertaClassificationHead


class RobertaForTokenClassification(EncoderForTokenClassification, RobertaPreTrainedModel):
    hf_twin = transformers.RobertaForTokenClassification


class RobertaForQuestionAnswering(EncoderForQuestionAnswering, RobertaPreTrainedModel):
    hf_twin = transformers.RobertaForQuestionAnswering


class RobertaForMultipleChoice(ForMultipleChoice, RobertaPreTrainedModel):
    hf_twin = transformers.RobertaForMultipleChoice

    @staticmethod
    def classifier_dropout(config) -> float:
        return config.hidden_dropout_prob
