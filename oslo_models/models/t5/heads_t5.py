"""T5's classification heads (``transformers``' ``T5ForSequenceClassification``, ``T5ForTokenClassification``,
``T5ForQuestionAnswering``) on the shared T5 pieces of ``modeling_t5.py``.

The heads are replicated (their inputs are the full, gathered ``[b, s, d]`` stack outputs); the encoder-decoder or
encoder under them is split by ``T5_PLAN`` exactly as in ``T5Model`` (prefixed ``transformer.`` where
``transformers`` nests it). Collectives are the stacks' (see ``modeling_t5.py``).
"""
from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import (
    Seq2SeqQuestionAnsweringModelOutput,
    Seq2SeqSequenceClassifierOutput,
)
from transformers.utils.generic import can_return_tuple

from ...parallel_layers.layers import Dropout, Embedding, Linear
from ...parallel_layers.plan import ParallelPlan
from ..bert.parallel_plan import prefixed
from ..common.attention.cache_names import seq2seq_fields
from ..heads import ForTokenClassification, sequence_classification_loss, span_logits_and_loss
from .modeling_t5 import (
    T5EncoderModel,
    T5Model,
    T5PreTrainedModel,
    T5Stack,
    _seq2seq_outputs,
    _stack_config,
)
from .parallel_plan import T5_STYLES

T5_NESTED_PLAN = ParallelPlan(prefixed("transformer", T5_STYLES))  # the T5Model / T5EncoderModel of a head model


def _decoder_inputs(model, input_ids, decoder_input_ids, decoder_inputs_embeds):
    """As ``transformers``: without decoder inputs, the decoder reads ``input_ids`` shifted right."""
    if decoder_input_ids is None and decoder_inputs_embeds is None:
        if input_ids is None:
            raise ValueError("If no `decoder_input_ids` or `decoder_inputs_embeds` are passed, `input_ids` cannot "
                             "be `None`. Please pass either `input_ids` or `decoder_input_ids` or "
                             "`decoder_inputs_embeds`.")
        decoder_input_ids = model._shift_right(input_ids)
    return decoder_input_ids


class T5ClassificationHead(nn.Module):
    """``out_proj(dropout(tanh(dense(dropout(x)))))`` on the last ``<eos>`` state, replicated."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.d_model, config.d_model)
        self.dropout = Dropout(config.classifier_dropout)
        self.out_proj = Linear(config.d_model, config.num_labels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = torch.tanh(self.dense(self.dropout(hidden_states)))
        return self.out_proj(self.dropout(hidden_states))


class T5ForSequenceClassification(T5PreTrainedModel):
    """``logits [b, num_labels]`` from the decoder state at each row's last ``<eos>`` of ``input_ids``."""

    parallel_plan = T5_NESTED_PLAN
    hf_twin = transformers.T5ForSequenceClassification

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.transformer = T5Model(config, parallel_context=self.parallel_context, submodule=True)
        self.classification_head = T5ClassificationHead(config)
        self.post_init()
        self.finish_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, inputs_embeds=None, decoder_inputs_embeds=None, labels=None, use_cache=None,
                **kwargs):
        if labels is not None:
            use_cache = False
        if input_ids is None and inputs_embeds is not None:
            raise NotImplementedError(f"Passing input embeddings is currently not supported for "
                                      f"{type(self).__name__}")
        decoder_input_ids = _decoder_inputs(self, input_ids, decoder_input_ids, decoder_inputs_embeds)
        outputs = self.transformer(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                                   decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs,
                                   inputs_embeds=inputs_embeds, decoder_inputs_embeds=decoder_inputs_embeds,
                                   use_cache=use_cache, return_dict=True, **kwargs)
        sequence_output = outputs.last_hidden_state
        eos_mask = input_ids.eq(self.config.eos_token_id).to(sequence_output.device)
        if len(torch.unique_consecutive(eos_mask.sum(1))) > 1:
            raise ValueError("All examples must have the same number of <eos> tokens.")
        batch_size, _, hidden_size = sequence_output.shape
        representation = sequence_output[eos_mask, :].view(batch_size, -1, hidden_size)[:, -1, :]
        logits = self.classification_head(representation)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return Seq2SeqSequenceClassifierOutput(loss=loss, logits=logits, **seq2seq_fields(outputs))


class T5ForTokenClassification(ForTokenClassification, T5PreTrainedModel):
    """The generic token-classification head (``models/heads.py``: ``classifier`` after ``dropout``, replicated,
    ``logits [b, s, num_labels]``) on the encoder (``T5EncoderModel`` under ``transformer``, as ``transformers``)."""

    parallel_plan = T5_NESTED_PLAN
    hf_twin = transformers.T5ForTokenClassification
    base_model_class = T5EncoderModel
    classifier_name = "classifier"

    def base_outputs(self, input_ids=None, *, position_ids=None, past_key_values=None, use_cache=None, **kwargs):
        """T5's encoder has relative positions and no cache: the generic head's ``position_ids`` /
        ``past_key_values`` / ``use_cache`` do not reach it."""
        return super().base_outputs(input_ids, **kwargs)


class T5ForQuestionAnswering(T5PreTrainedModel):
    """Encoder-decoder (``shared``/``encoder``/``decoder`` at the top, as ``transformers``) and a replicated span
    head ``qa_outputs`` on the decoder output: ``start_logits, end_logits [b, s_dec]``."""

    hf_twin = transformers.T5ForQuestionAnswering
    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight",
                          "decoder.embed_tokens.weight": "shared.weight"}

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.model_dim = config.d_model
        self.shared = Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(_stack_config(config, is_decoder=False), parallel_context=self.parallel_context)
        self.decoder = T5Stack(_stack_config(config, is_decoder=True), parallel_context=self.parallel_context)
        self.num_labels = config.num_labels
        self.qa_outputs = Linear(config.hidden_size, config.num_labels)
        self.post_init()
        self.finish_init()

    def get_input_embeddings(self):
        return self.shared

    def get_encoder(self):
        return self.encoder

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, start_positions=None, end_positions=None, inputs_embeds=None,
                decoder_inputs_embeds=None, use_cache=None, **kwargs):
        if start_positions is not None and end_positions is not None:
            use_cache = False
        decoder_input_ids = _decoder_inputs(self, input_ids, decoder_input_ids, decoder_inputs_embeds)
        encoder_outputs, decoder_outputs = self.run_stacks(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, None,
            inputs_embeds, decoder_inputs_embeds, use_cache, **kwargs)
        logits = self.qa_outputs(decoder_outputs.last_hidden_state)
        start_logits, end_logits, loss = span_logits_and_loss(logits, start_positions, end_positions)
        return Seq2SeqQuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                                   **_seq2seq_outputs(encoder_outputs, decoder_outputs))
