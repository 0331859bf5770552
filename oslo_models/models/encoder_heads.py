"""Task heads of the encoder families (BERT, RoBERTa and its variants, DistilBERT, ELECTRA, ALBERT), written
once: each family's head is a short declaration naming ``transformers``' head modules, as ``models/heads.py`` does
for the decoders (whose outputs and loss rules these share).

What stays per family is only what differs in ``transformers``' module tree: the MLM head module (BERT's
``cls.predictions.{transform, decoder, bias}``, RoBERTa's ``lm_head.{dense, layer_norm, decoder, bias}``: a module
with ``features(h)`` before its vocab-parallel ``decoder`` and a ``tp_plan`` fragment), the sequence classifier
(BERT: dropout and ``classifier`` on the pooled ``[CLS]`` state; RoBERTa: its own ``classifier.dense/out_proj``
module on ``<s>``) and the dropout rule. Classification heads are replicated (their inputs are full ``[b, s, h]``);
the MLM decoder is vocab-parallel and its loss runs on the vocab-split logits.
"""
from __future__ import annotations

from typing import ClassVar

import torch.nn.functional as F
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import (
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    NextSentencePredictorOutput,
    SequenceClassifierOutput,
)
from transformers.utils.generic import can_return_tuple

from ..parallel_layers.layers import Dropout, Linear
from ..utils.documents import PACKING_KEYS
from .common.attention.cache_names import cache_field, output_cache
from .common.attention.encoder_masks import PACKED_HEAD_REFUSAL, is_packed_batch
from .common.loss.head_rules import (
    MASKED_LM,
    MULTIPLE_CHOICE,
    QUESTION_ANSWERING,
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
    HeadParts,
)
from .common.loss.lm_loss import head_loss_and_logits, keep_last_logits
from .common.pipeline.pipeline_encoder import EncoderPipelineAdapter
from .common.stack.context_parallel import context_parallel_loss, context_parallel_loss_items
from .common.stack.outputs import passed_on
from .heads import (
    HeadModel,
    flatten_choices,
    multiple_choice_output,
    question_answering_output,
    token_classification_output,
)


def classifier_dropout(config) -> float:
    """BERT's rule: ``classifier_dropout``, else ``hidden_dropout_prob``."""
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob


class _HeadStyles:
    """``head_styles`` of a head whose module ``head_class`` (at ``head_name``) carries its own ``tp_plan``."""

    def __get__(self, obj, cls):
        return {f"{cls.head_name}.{pattern}" if pattern else cls.head_name: style
                for pattern, style in getattr(cls.head_class, "tp_plan", {}).items()}


class _BoundPipelineAdapter:
    """``pipeline_adapter`` of an encoder head: ``pipeline_adapter_class.of(head class)`` (the adapter counts
    parameters on the head class built on the meta device), or ``None`` when the head has no pipeline stages (no
    ``head_rule``, or ``pipeline_adapter_class = None``)."""

    def __get__(self, obj, cls):
        if cls.pipeline_adapter_class is None or cls.head_rule is None:
            return None
        adapter = cls.__dict__.get("_bound_adapter")
        if adapter is None:
            adapter = cls.pipeline_adapter_class.of(cls)
            setattr(cls, "_bound_adapter", adapter)
        return adapter


class EncoderHeadModel(HeadModel):
    """A head on an encoder base model (``base_model_class`` under ``base_model_prefix``), built with the pooler
    only when the head reads it (``uses_pooler``, ``transformers``' ``add_pooling_layer``). The base takes
    ``token_type_ids`` besides the decoder heads' inputs."""

    uses_pooler: ClassVar[bool] = False
    #: the family's classifier dropout rule (ALBERT: ``classifier_dropout_prob``; RoBERTa's multiple choice:
    #: ``hidden_dropout_prob``)
    classifier_dropout = staticmethod(classifier_dropout)
    pipeline_adapter = _BoundPipelineAdapter()
    pipeline_adapter_class: ClassVar[type | None] = EncoderPipelineAdapter
    #: the task's head rule (``common/loss/head_rules.py``), run by ``forward`` and by a pipeline's last stage
    head_rule: ClassVar = None
    #: the head's outputs are per token, so a packed batch (several documents per row, attending within
    #: themselves: ``common/attention/encoder_masks.py``) gives each document's own values; per-row heads (pooled
    #: classification, spans, choices, NSP/SOP) refuse packed batches with the reason
    accepts_packed: ClassVar[bool] = False
    #: what the per-row output is, for the refusal's message
    per_row_output: ClassVar[str] = "a pooled or per-row prediction"

    def __init__(self, config, *, parallel_context=None):
        super(HeadModel, self).__init__(config, parallel_context=parallel_context)
        setattr(self, self.base_model_prefix, self.base_model_class(
            config, add_pooling_layer=self.uses_pooler, parallel_context=self.parallel_context, submodule=True))
        self.build_head(config)
        self.post_init()
        self.finish_init()

    @classmethod
    def pooler_modules(cls) -> dict[str, str]:
        """The modules ``pool`` reads, ``{attribute: module path}`` (BERT: the base model's ``pooler``)."""
        return {"pooler": f"{cls.base_model_prefix}.pooler"}

    @classmethod
    def pool(cls, holder, hidden):
        """The pooled first token ``[b, h]`` from ``hidden [b, s, h]``, on the modules of ``pooler_modules()``."""
        return holder.pooler(hidden)

    def run_head(self, hidden, attention_mask=None, pooled=None):
        """The task rule's logits on this model's head modules (what a pipeline's last stage runs on its own)."""
        parts = HeadParts(self, self.head_rule.modules(type(self)))
        return self.head_rule.logits(type(self), parts, hidden, attention_mask, self.config, pooled=pooled)

    def encode(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
               **kwargs):
        """The base model's output object (``last_hidden_state [b, s, h]``, ``pooler_output [b, h]``, ...).
        ``ValueError`` for a packed batch when the head is per row (``accepts_packed``)."""
        if not self.accepts_packed and is_packed_batch(input_ids, inputs_embeds, attention_mask, position_ids,
                                                       {key: kwargs.get(key) for key in PACKING_KEYS}):
            raise ValueError(PACKED_HEAD_REFUSAL.format(name=type(self).__name__, what=self.per_row_output))
        return self.base_outputs(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                 position_ids=position_ids, inputs_embeds=inputs_embeds, **kwargs)


class _MLMTiedKeys:
    """``_tied_weights_keys`` of an MLM head: the decoder's weight (``mlm_decoder_path``) is the word embeddings (the
    spec's ``embed_tokens``); a decoder under ``_decoder_bias_owner`` also ties its bias to the owner's ``bias``."""

    def __get__(self, obj, cls):
        decoder = cls.mlm_decoder_path()
        keys = {f"{decoder}.weight": f"{cls.base_model_prefix}.{cls.stack_spec.embed_tokens}.weight"}
        if cls.decoder_path is None and cls._decoder_bias_owner is not None:
            keys[f"{decoder}.bias"] = f"{cls._decoder_bias_owner}.bias"
        return keys


class ForMaskedLM(EncoderHeadModel):
    """The encoder with its MLM head ``head_class`` at ``head_name``: a replicated transform (``features``), then the
    vocab-parallel ``decoder`` (weight tied to the word embeddings, bias to the head's ``bias`` at
    ``_decoder_bias_owner``). The loss runs on the vocab-split logits; ``logits`` are gathered to ``[b, s, V]``
    unless ``gather_logits=False`` (``[b, s, V_padded/tp]``) and ``None`` with ``skip_logits=True`` (fused, chunked
    loss: ``common/loss/lm_loss.py``). Under context parallelism the loss is the mean over the whole sequence."""

    head_name: ClassVar[str] = "cls"
    head_class: ClassVar[type] = None
    head_styles = _HeadStyles()
    head_rule = MASKED_LM
    accepts_packed = True  # per-token loss and logits
    _decoder_bias_owner: ClassVar[str | None] = None
    #: the vocab-parallel decoder's module path when it is not ``{_decoder_bias_owner}.decoder`` (ELECTRA's
    #: ``generator_lm_head``, DistilBERT's ``vocab_projector``: top-level linears with their own bias)
    decoder_path: ClassVar[str | None] = None
    #: the modules ``mlm_transform`` reads, when not the one module at ``head_name`` (DistilBERT's transform, activation
    #: and norm live on the model itself); a pipeline's last stage holds them under these names
    mlm_head_modules: ClassVar[tuple[str, ...] | None] = None
    _tied_weights_keys = _MLMTiedKeys()

    @classmethod
    def mlm_decoder_path(cls) -> str:
        return cls.decoder_path or f"{cls._decoder_bias_owner}.decoder"

    @classmethod
    def mlm_head_module_names(cls) -> tuple[str, ...]:
        return cls.mlm_head_modules or (cls.head_name,)

    def build_head(self, config) -> None:
        setattr(self, self.head_name, self.head_class(config))

    @classmethod
    def mlm_transform(cls, holder, hidden):
        """The replicated transform before the decoder, ``[b, s, h] -> [b, s, e]``, run on the modules of
        ``mlm_head_module_names()`` found on ``holder`` (the model, or a pipeline's last stage holding them under
        the same names): the ``features`` of the module at ``head_name``."""
        return getattr(holder, cls.head_name).features(hidden)

    def mlm_features(self, hidden):
        return self.mlm_transform(self, hidden)

    def get_output_embeddings(self):
        try:
            return self.get_submodule(self.mlm_decoder_path())
        except AttributeError:  # off a pipeline's last stage the head is dropped
            return None

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, gather_logits: bool = True, num_items_in_batch=None,
                skip_logits: bool = False, **kwargs) -> MaskedLMOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        if labels is not None:
            num_items_in_batch = context_parallel_loss_items(self, labels, num_items_in_batch, causal=False)
        features = self.mlm_features(outputs.last_hidden_state)
        loss, logits = head_loss_and_logits(self.get_output_embeddings(), features, labels, causal=False,
                                            skip_logits=skip_logits, fused=self.parallel_context.config.fused_ops,
                                            gather_logits=gather_logits, num_items_in_batch=num_items_in_batch)
        return MaskedLMOutput(loss=context_parallel_loss(self, loss), logits=logits, **passed_on(outputs))


class EncoderForCausalLM(ForMaskedLM, GenerationMixin):
    """The encoder as a causal decoder (``config.is_decoder``: causal mask, key/value cache) over its MLM head
    (``BertLMHeadModel``, ``RobertaForCausalLM``); the loss is the causal-LM loss on the vocab-split logits."""

    pipeline_adapter_class = None

    @classmethod
    def can_generate(cls) -> bool:
        """``True``: ``transformers`` looks for ``GenerationMixin`` among a class's direct bases only."""
        return True

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, past_key_values=None, use_cache=None, logits_to_keep=0,
                gather_logits: bool = True, num_items_in_batch=None, shift_labels=None, skip_logits: bool = False,
                **kwargs) -> CausalLMOutputWithCrossAttentions:
        if labels is not None:
            use_cache = False
        outputs = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                              past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        hidden = keep_last_logits(outputs.last_hidden_state, logits_to_keep)
        # As transformers: shift_labels (pre-shifted targets) only alongside labels.
        loss, logits = head_loss_and_logits(self.get_output_embeddings(), getattr(self, self.head_name).features(hidden),
                                            labels, causal=True, skip_logits=skip_logits,
                                            fused=self.parallel_context.config.fused_ops, gather_logits=gather_logits,
                                            num_items_in_batch=num_items_in_batch, shift_labels=shift_labels)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits, **cache_field(output_cache(outputs)),
                                                 cross_attentions=getattr(outputs, "cross_attentions", None),
                                                 **passed_on(outputs))


class EncoderForSequenceClassification(EncoderHeadModel):
    """``logits [b, num_labels]``. Without ``head_class`` (BERT): ``classifier(dropout(pooled [CLS] state))``;
    with one (RoBERTa's ``classifier.dense/out_proj`` on ``<s>``): ``classifier(last_hidden_state)``, no pooler."""

    per_row_output = "one label per row from the first token or the pooler"
    head_rule = SEQUENCE_CLASSIFICATION

    head_class: ClassVar[type | None] = None

    @property
    def uses_pooler(self) -> bool:
        return self.head_class is None

    def build_head(self, config) -> None:
        self.num_labels = config.num_labels
        if self.head_class is None:
            self.dropout = Dropout(self.classifier_dropout(config))
            self.classifier = Linear(config.hidden_size, config.num_labels)
        else:
            self.classifier = self.head_class(config)

    def classify(self, outputs):
        return self.run_head(outputs.last_hidden_state, pooled=getattr(outputs, "pooler_output", None))

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs) -> SequenceClassifierOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self.classify(outputs)
        # the task rule's loss (DeBERTa's keeps its own), the one a pipeline's last stage runs
        loss = self.head_rule.classification_loss(logits, labels, self.config) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, **passed_on(outputs))


class EncoderForTokenClassification(EncoderHeadModel):
    """Replicated ``classifier`` (after ``dropout``) on every token: ``logits [b, s, num_labels]``."""

    accepts_packed = True
    head_rule = TOKEN_CLASSIFICATION

    def build_head(self, config) -> None:
        self.num_labels = config.num_labels
        self.dropout = Dropout(self.classifier_dropout(config))
        self.classifier = Linear(config.hidden_size, config.num_labels)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, num_items_in_batch=None, **kwargs):
        outputs = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        return token_classification_output(self.run_head(outputs.last_hidden_state), labels, outputs,
                                           num_items_in_batch)


class EncoderForQuestionAnswering(EncoderHeadModel):
    """Replicated span head ``qa_outputs`` (``config.num_labels`` outputs, as ``transformers``' encoders):
    ``start_logits, end_logits [b, s]``."""

    per_row_output = "one answer span per row"
    head_rule = QUESTION_ANSWERING

    #: whether a ``dropout`` runs before ``qa_outputs`` (DistilBERT's ``qa_dropout``)
    span_dropout: ClassVar[bool] = False

    def build_head(self, config) -> None:
        self.num_labels = config.num_labels
        self.qa_outputs = Linear(config.hidden_size, config.num_labels)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, **kwargs):
        outputs = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        return question_answering_output(self.run_head(outputs.last_hidden_state), start_positions, end_positions,
                                         outputs)


class ForMultipleChoice(EncoderHeadModel):
    """``[b, c, s]`` inputs flattened to ``[b*c, s]``; one replicated score per choice from the pooled state:
    ``logits [b, c]``. ``classifier_dropout(config)``: the family's dropout rule (RoBERTa: ``hidden_dropout_prob``)."""

    per_row_output = "one pooled score per choice row"
    head_rule = MULTIPLE_CHOICE

    uses_pooler = True

    def build_head(self, config) -> None:
        self.dropout = Dropout(self.classifier_dropout(config))
        self.classifier = Linear(config.hidden_size, 1)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs):
        num_choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        outputs = self.encode(*flatten_choices(input_ids, attention_mask, token_type_ids, position_ids,
                                               inputs_embeds), **kwargs)
        logits = self.run_head(outputs.last_hidden_state, pooled=getattr(outputs, "pooler_output", None))  # [b*c, 1]
        return multiple_choice_output(logits, labels, num_choices, outputs)


class ForNextSentencePrediction(EncoderHeadModel):
    """``logits [b, 2]`` from the pooled ``[CLS]`` state through ``head_class`` at ``head_name``; cross-entropy
    with ``labels``."""

    per_row_output = "next-sentence prediction on the pooled first token"

    uses_pooler = True
    head_name: ClassVar[str] = "cls"
    head_class: ClassVar[type] = None

    def build_head(self, config) -> None:
        setattr(self, self.head_name, self.head_class(config))

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs):
        outputs = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = getattr(self, self.head_name)(outputs.pooler_output)
        loss = F.cross_entropy(logits.view(-1, 2), labels.view(-1)) if labels is not None else None
        return NextSentencePredictorOutput(loss=loss, logits=logits, **passed_on(outputs))
