"""BART's other heads (``transformers``' ``BartForSequenceClassification``, ``BartForQuestionAnswering``,
``BartForCausalLM``) on the pieces of ``modeling_bart.py``.

The classification and span heads are replicated (their inputs are the full, gathered ``[b, s_dec, d]`` decoder
output); the model under them is split by the same plan as ``BartModel`` (under ``model.``). ``BartForCausalLM`` is
the decoder alone (``model.decoder``, no cross-attention unless ``encoder_hidden_states`` are given) with a
vocab-parallel ``lm_head`` tied to ``model.decoder.embed_tokens``; as ``transformers``, its loss does **not**
shift the labels (``labels[..., i]`` is the target of ``logits[..., i, :]``).
"""
from __future__ import annotations

import torch
import transformers
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import (
    CausalLMOutputWithCrossAttentions,
    Seq2SeqQuestionAnsweringModelOutput,
    Seq2SeqSequenceClassifierOutput,
)
from transformers.utils.generic import can_return_tuple

from ...parallel_layers.layers import Dropout, Linear
from ...parallel_layers.plan import Colwise, ParallelPlan
from ..common.attention.cache_names import cache_field, output_cache, seq2seq_fields
from ..common.loss.lm_loss import full_logits, keep_last_logits, token_loss
from ..heads import sequence_classification_loss, span_logits_and_loss
from .modeling_bart import BART_DECODER_SPEC, BartDecoder, BartModel, BartPreTrainedModel, bart_styles
from .pipeline_bart import BartQuestionAnsweringPipelineAdapter, BartSequenceClassificationPipelineAdapter


class BartClassificationHead(torch.nn.Module):
    """``out_proj(dropout(tanh(dense(dropout(x)))))`` on the last ``<eos>`` state, replicated."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.d_model, config.d_model)
        self.dropout = Dropout(config.classifier_dropout)
        self.out_proj = Linear(config.d_model, config.num_labels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = torch.tanh(self.dense(self.dropout(hidden_states)))
        return self.out_proj(self.dropout(hidden_states))


def eos_positions(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """``[b, s]`` bool: the ``<eos>`` tokens of ``input_ids``; ``ValueError`` unless every row has the same number
    (at least one), as ``transformers`` requires."""
    eos_mask = input_ids.eq(eos_token_id)
    counts = torch.unique_consecutive(eos_mask.sum(1))
    if counts.numel() != 1:
        raise ValueError("All examples must have the same number of <eos> tokens.")
    if int(counts[0]) < 1:
        raise ValueError("Each example must contain at least one <eos> token.")
    return eos_mask


def last_eos_state(hidden_states: torch.Tensor, eos_mask: torch.Tensor) -> torch.Tensor:
    """``[b, s, d] -> [b, d]``: each row's state at its last ``<eos>`` (``eos_mask`` from ``eos_positions``)."""
    batch_size, _, hidden_size = hidden_states.shape
    return hidden_states[eos_mask.to(hidden_states.device), :].view(batch_size, -1, hidden_size)[:, -1, :]


def eos_representation(hidden_states: torch.Tensor, input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """``[b, s, d] -> [b, d]``: each row's state at its last ``<eos>`` of ``input_ids``."""
    return last_eos_state(hidden_states, eos_positions(input_ids, eos_token_id))


class _BartHead(BartPreTrainedModel):
    """A head over ``BartModel`` at ``model`` (its plan under ``model.``; the head itself replicated)."""

    parallel_plan = ParallelPlan(bart_styles("model"))
    grid_refusal = ("its replicated head reads whole decoder states, which the grid modes split over batch and "
                    "hidden")

    def build_model(self, config) -> None:
        self.model = BartModel(config, parallel_context=self.parallel_context, submodule=True)

    def get_input_embeddings(self):
        return self.model.shared

    def get_encoder(self):
        return self.model.encoder


class BartForSequenceClassification(_BartHead):
    """``logits [b, num_labels]`` from the decoder state at each row's last ``<eos>`` of ``input_ids``; pipeline
    stages: ``pipeline_bart.py``."""

    hf_twin = transformers.BartForSequenceClassification
    pipeline_adapter = BartSequenceClassificationPipelineAdapter

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.build_model(config)
        self.classification_head = BartClassificationHead(config)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, inputs_embeds=None, decoder_inputs_embeds=None, labels=None, use_cache=None,
                **kwargs) -> Seq2SeqSequenceClassifierOutput:
        if labels is not None:
            use_cache = False
        if input_ids is None and inputs_embeds is not None:
            raise NotImplementedError(f"Passing input embeddings is currently not supported for "
                                      f"{type(self).__name__}")
        outputs = self.model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                             decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs,
                             inputs_embeds=inputs_embeds, decoder_inputs_embeds=decoder_inputs_embeds,
                             use_cache=use_cache, return_dict=True, **kwargs)
        representation = eos_representation(outputs.last_hidden_state, input_ids, self.config.eos_token_id)
        logits = self.classification_head(representation)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return Seq2SeqSequenceClassifierOutput(loss=loss, logits=logits, **seq2seq_fields(outputs))


class BartForQuestionAnswering(_BartHead):
    """Replicated span head ``qa_outputs`` on the decoder output: ``start_logits, end_logits [b, s_dec]``."""

    hf_twin = transformers.BartForQuestionAnswering
    pipeline_adapter = BartQuestionAnsweringPipelineAdapter

    def __init__(self, config, *, parallel_context=None):
        config.num_labels = 2  # as transformers
        super().__init__(config, parallel_context=parallel_context)
        self.num_labels = config.num_labels
        self.build_model(config)
        self.qa_outputs = Linear(config.hidden_size, config.num_labels)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, start_positions=None, end_positions=None, inputs_embeds=None,
                decoder_inputs_embeds=None, use_cache=None, **kwargs) -> Seq2SeqQuestionAnsweringModelOutput:
        if start_positions is not None and end_positions is not None:
            use_cache = False
            start_positions, end_positions = start_positions.view(-1), end_positions.view(-1)
        outputs = self.model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                             decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs,
                             inputs_embeds=inputs_embeds, decoder_inputs_embeds=decoder_inputs_embeds,
                             use_cache=use_cache, return_dict=True, **kwargs)
        start_logits, end_logits, loss = span_logits_and_loss(self.qa_outputs(outputs.last_hidden_state),
                                                              start_positions, end_positions)
        return Seq2SeqQuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                                   **seq2seq_fields(outputs))


class BartDecoderWrapper(BartPreTrainedModel):
    """``transformers``' wrapper that puts the decoder at ``model.decoder`` (checkpoint keys of ``BartForCausalLM``)."""

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.decoder = BartDecoder(config, parallel_context=self.parallel_context)
        self.post_init()

    def forward(self, *args, **kwargs):
        return self.decoder(*args, **kwargs)


class BartForCausalLM(BartPreTrainedModel, GenerationMixin):
    """The decoder with a vocab-parallel ``lm_head`` (tied to ``model.decoder.embed_tokens`` when
    ``tie_word_embeddings``). Loss on the vocab-split logits, labels not shifted (``transformers``' rule);
    ``logits [b, s, V]`` unless ``gather_logits=False``."""

    hf_twin = transformers.BartForCausalLM
    labels_shifted_in_loss = False  # transformers' BartForCausalLM: a plain CrossEntropyLoss, no shift
    parallel_plan = ParallelPlan({**BART_DECODER_SPEC.plan("model.decoder").styles, "lm_head": Colwise(vocab=True)})
    _tied_weights_keys = {"lm_head.weight": "model.decoder.embed_tokens.weight"}

    def __init__(self, config, *, parallel_context=None):
        config.is_decoder, config.is_encoder_decoder = True, False  # as transformers
        super().__init__(config, parallel_context=parallel_context)
        self.model = BartDecoderWrapper(config, parallel_context=self.parallel_context)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.finish_init()

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def get_input_embeddings(self):
        return self.model.decoder.embed_tokens

    def set_input_embeddings(self, value):
        self.model.decoder.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def tie_parallel_weights(self) -> None:
        if self.config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None, cache=None,
                logits_to_keep=0, gather_logits: bool = True, num_items_in_batch=None,
                **kwargs) -> CausalLMOutputWithCrossAttentions:
        kwargs.pop("return_dict", None)
        outputs = self.model.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                     encoder_hidden_states=encoder_hidden_states,
                                     encoder_attention_mask=encoder_attention_mask,
                                     past_key_values=cache if past_key_values is None else past_key_values,
                                     inputs_embeds=inputs_embeds, use_cache=use_cache, return_dict=True, **kwargs)
        local_logits = self.lm_head(keep_last_logits(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = token_loss(local_logits, labels, self.lm_head, num_items_in_batch=num_items_in_batch)
        return CausalLMOutputWithCrossAttentions(
            loss=loss, logits=full_logits(local_logits, self.lm_head, gather_logits),
            **cache_field(output_cache(outputs)),
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            cross_attentions=outputs.cross_attentions)
