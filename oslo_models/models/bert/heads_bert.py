"""BERT's remaining ``transformers`` heads, on the shared encoder and head pieces of ``modeling_bert.py``.

- ``BertLMHeadModel``: BERT as a causal decoder (``config.is_decoder``: causal mask, key/value cache) with the
  vocab-parallel MLM head; the loss is the causal-LM loss on the vocab-split logits (no full logits needed).
- ``BertForNextSentencePrediction``: the replicated ``seq_relationship`` head on the pooled ``[CLS]`` state.
- ``BertForMultipleChoice``: ``[b, c, s]`` inputs flattened to ``[b*c, s]``, one replicated score per choice.

The encoder is ``base_model_class`` under ``base_model_prefix``, so RoBERTa reuses these classes with its own
encoder and keys (``roberta.*``). Collectives are the encoder's (see ``modeling_bert.py``).
"""
from __future__ import annotations

import torch.nn.functional as F
import transformers
from torch import nn
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, NextSentencePredictorOutput
from transformers.utils.generic import can_return_tuple

from ...parallel_layers.layers import Dropout, Linear
from ..common import keep_last_logits
from ..common.lm_loss import head_loss_and_logits
from ..common.outputs import passed_on
from ..heads import flatten_choices, multiple_choice_output
from .modeling_bert import BertForMaskedLM, BertModel, BertOnlyMLMHead, BertPreTrainedModel, _base_kwargs
from .parallel_plan import BERT_HEAD_PLAN, BERT_MLM_PLAN


class BertLMHeadModel(BertPreTrainedModel, GenerationMixin):
    """Causal LM over the MLM head. ``logits [b, s, V]`` (gathered unless ``gather_logits=False``).

    The head module is ``head_class`` under ``head_name``; its vocab-parallel ``decoder`` sits in the module
    ``_decoder_bias_owner`` names (RoBERTa: ``lm_head``)."""

    parallel_plan = BERT_MLM_PLAN
    hf_twin = transformers.BertLMHeadModel
    base_model_class = BertModel
    head_name, head_class = "cls", BertOnlyMLMHead
    _decoder_bias_owner = "cls.predictions"
    _tied_weights_keys = BertForMaskedLM._tied_weights_keys

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        setattr(self, self.base_model_prefix, self.base_model_class(
            config, add_pooling_layer=False, parallel_context=self.parallel_context, submodule=True))
        setattr(self, self.head_name, self.head_class(config))
        self.post_init()
        self.finish_init()

    def get_output_embeddings(self):
        return self.get_submodule(self._decoder_bias_owner).decoder

    def get_input_embeddings(self):
        return self.base_model.get_input_embeddings()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, past_key_values=None, use_cache=None, logits_to_keep=0,
                gather_logits: bool = True, num_items_in_batch=None, shift_labels=None, skip_logits: bool = False,
                **kwargs):
        if labels is not None:
            use_cache = False
        outputs = self.base_model(**_base_kwargs(input_ids, attention_mask, token_type_ids, position_ids,
                                                 inputs_embeds, kwargs), past_key_values=past_key_values,
                                  use_cache=use_cache)
        features = getattr(self, self.head_name).features(keep_last_logits(outputs.last_hidden_state, logits_to_keep))
        # logits [b, s, V] ([b, s, V_padded/tp] with gather_logits=False; None with skip_logits, see lm_loss.py).
        # As transformers: shift_labels (pre-shifted targets) only alongside labels.
        loss, logits = head_loss_and_logits(self.get_output_embeddings(), features, labels, causal=True,
                                            skip_logits=skip_logits, fused=self.parallel_context.config.fused_ops,
                                            gather_logits=gather_logits, num_items_in_batch=num_items_in_batch,
                                            shift_labels=shift_labels)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits,
                                                 past_key_values=outputs.past_key_values,
                                                 cross_attentions=outputs.cross_attentions, **passed_on(outputs))


class BertOnlyNSPHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.seq_relationship = Linear(config.hidden_size, 2)

    def forward(self, pooled_output):
        return self.seq_relationship(pooled_output)


class BertForNextSentencePrediction(BertPreTrainedModel):
    """``logits [b, 2]`` from the pooled ``[CLS]`` state; cross-entropy with ``labels``."""

    parallel_plan = BERT_HEAD_PLAN
    hf_twin = transformers.BertForNextSentencePrediction

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.bert = BertModel(config, parallel_context=self.parallel_context, submodule=True)
        self.cls = BertOnlyNSPHead(config)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs):
        outputs = self.bert(**_base_kwargs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                           kwargs))
        logits = self.cls(outputs.pooler_output)
        loss = F.cross_entropy(logits.view(-1, 2), labels.view(-1)) if labels is not None else None
        return NextSentencePredictorOutput(loss=loss, logits=logits, **passed_on(outputs))


class BertForMultipleChoice(BertPreTrainedModel):
    """``[b, c, s]`` inputs; one score per choice from the pooled state: ``logits [b, c]``."""

    parallel_plan = BERT_HEAD_PLAN
    hf_twin = transformers.BertForMultipleChoice
    base_model_class = BertModel

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        setattr(self, self.base_model_prefix, self.base_model_class(
            config, parallel_context=self.parallel_context, submodule=True))
        self.dropout = Dropout(self.classifier_dropout(config))
        self.classifier = Linear(config.hidden_size, 1)
        self.post_init()
        self.finish_init()

    @staticmethod
    def classifier_dropout(config) -> float:
        return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs):
        num_choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        flat = flatten_choices(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        outputs = self.base_model(**_base_kwargs(*flat, kwargs))
        logits = self.classifier(self.dropout(outputs.pooler_output))  # [b*c, 1]
        return multiple_choice_output(logits, labels, num_choices, outputs)
