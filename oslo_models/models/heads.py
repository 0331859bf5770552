"""Task heads, written once: the generic heads of the stack families (``ForCausalLM``, ``ForSequenceClassification``,
``ForTokenClassification``, ``ForQuestionAnswering``; a family's head is a one-line declaration, as ``transformers``
v5 writes ``GenericFor*``), and the outputs and loss rules every family's heads share (the same rules as
``transformers``). Classification heads are replicated (never split): their inputs are full ``[b, s, h]``."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.utils.generic import can_return_tuple

from ..parallel_layers.layers import Dropout, Linear
from ..parallel_layers.plan import Colwise
from .common.attention.cache_names import cache_field, output_cache
from .common.pipeline.pipeline_stack import StackPipelineAdapter
from .common.rules.capabilities import Capabilities
from .common.stack import context_parallel as cp
from .common.stack.context_parallel import causal_lm_head_outputs
from .common.stack.outputs import passed_on


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """``logits [b, num_labels]``; regression, single- or multi-label as ``config.problem_type`` says (and sets
    it the first time from ``num_labels`` and the label dtype, as ``transformers`` does)."""
    num_labels = logits.shape[-1]
    if config.problem_type is None:
        if num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    labels = labels.to(logits.device)
    if config.problem_type == "regression":
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze())
        return F.mse_loss(logits, labels)
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels)


def last_token_logits(logits: torch.Tensor, input_ids: torch.Tensor | None, pad_token_id: int | None) -> torch.Tensor:
    """``logits [b, s, num_labels]`` -> ``[b, num_labels]`` at each row's rightmost non-padding token (left or right
    padding), as ``transformers``' decoder sequence classifiers pool; the last position without ``input_ids``."""
    batch_size = logits.shape[0]
    if pad_token_id is None and batch_size != 1:
        raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
    if pad_token_id is None or input_ids is None:
        last_token = torch.full((batch_size,), -1, device=logits.device, dtype=torch.long)
    else:
        non_pad = (input_ids != pad_token_id).to(logits.device, torch.int32)
        positions = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
        last_token = (positions * non_pad).argmax(-1)
    return logits[torch.arange(batch_size, device=logits.device), last_token]


def token_classification_output(logits, labels, base_outputs=None, num_items_in_batch=None) -> TokenClassifierOutput:
    """``logits [b, s, num_labels]``; cross-entropy over every token (``-100`` ignored): the mean, or the sum over
    ``num_items_in_batch`` when given (the global batch's divisor, ``training/global_batch.py``)."""
    loss = None
    if labels is not None:
        flat_logits, flat_labels = logits.view(-1, logits.shape[-1]), labels.to(logits.device).view(-1)
        if num_items_in_batch is None:
            loss = F.cross_entropy(flat_logits, flat_labels)
        else:
            loss = F.cross_entropy(flat_logits, flat_labels, reduction="sum") / num_items_in_batch
    return TokenClassifierOutput(loss=loss, logits=logits, **passed_on(base_outputs))


def span_logits_and_loss(logits, start_positions, end_positions):
    """``logits [b, s, 2]`` -> ``(start_logits [b, s], end_logits [b, s], loss)``; the loss as ``transformers``
    (positions outside the sequence are clamped to ``s`` and ignored), ``None`` without positions."""
    start_logits, end_logits = (part.squeeze(-1).contiguous() for part in logits.split(1, dim=-1))
    loss = None
    if start_positions is not None and end_positions is not None:
        ignored = start_logits.size(1)
        start = start_positions.view(-1).clamp(0, ignored).to(logits.device)
        end = end_positions.view(-1).clamp(0, ignored).to(logits.device)
        loss = (F.cross_entropy(start_logits, start, ignore_index=ignored)
                + F.cross_entropy(end_logits, end, ignore_index=ignored)) / 2
    return start_logits, end_logits, loss


def question_answering_output(logits, start_positions, end_positions,
                              base_outputs=None) -> QuestionAnsweringModelOutput:
    """``QuestionAnsweringModelOutput`` of a span head (see ``span_logits_and_loss``)."""
    start_logits, end_logits, loss = span_logits_and_loss(logits, start_positions, end_positions)
    return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                        **passed_on(base_outputs))


def multiple_choice_output(logits, labels, num_choices: int, base_outputs=None) -> MultipleChoiceModelOutput:
    """``logits [b*c, 1]`` (one score per flattened choice) -> ``[b, c]``; cross-entropy over the choices."""
    logits = logits.view(-1, num_choices)
    loss = F.cross_entropy(logits, labels.to(logits.device)) if labels is not None else None
    return MultipleChoiceModelOutput(loss=loss, logits=logits, **passed_on(base_outputs))


def flatten_choices(*tensors):
    """``[b, c, ...]`` inputs of a multiple-choice head -> ``[b*c, ...]`` (``None`` stays ``None``)."""
    return tuple(None if t is None else t.reshape(-1, *t.shape[2:]) for t in tensors)


# ---------------------------------------------------------------------------------------------- generic heads
class _DerivedPlan:
    """``parallel_plan`` of a stack family's class, derived from its ``stack_spec`` (base model: the spec's plan;
    a head: the spec's plan under ``base_model_prefix`` plus the head's ``head_styles``). Computed once per class."""

    def __get__(self, obj, cls):
        plan = cls.__dict__.get("_derived_plan")
        if plan is None:
            prefix = "" if getattr(cls, "is_base_model", False) else cls.base_model_prefix
            plan = cls.stack_spec.plan(prefix, **getattr(cls, "head_styles", {}))
            setattr(cls, "_derived_plan", plan)
        return plan


class _DerivedPipelineAdapter:
    """``pipeline_adapter`` of a causal LM head over a stack: ``pipeline_adapter_class.of(base, prefix)``."""

    def __get__(self, obj, cls):
        adapter = cls.__dict__.get("_derived_adapter")
        if adapter is None:
            adapter = cls.pipeline_adapter_class.of(cls.base_model_class, cls.base_model_prefix,
                                                    grid_modes=cls.pipeline_grid_modes)
            setattr(cls, "_derived_adapter", adapter)
        return adapter


class _DerivedTiedKeys:
    """``_tied_weights_keys`` of a causal LM head over a stack: ``lm_head.weight`` is the input embedding. A pipeline
    stage that does not hold the input embedding ties nothing within itself (its head's copy is kept in step by the
    pipeline): ``None`` there, so a caller such as ``peft``'s tie check does not look for an embedding it lacks."""

    def __get__(self, obj, cls):
        if (obj is not None and cls.base_model_prefix in obj._modules
                and getattr(obj, "parallel_context", None) is not None and obj.parallel_context.pp_size > 1
                and obj.get_input_embeddings() is None):
            return None
        return {"lm_head.weight": f"{cls.base_model_prefix}.{cls.stack_spec.embed_tokens}.weight"}


class StackFamilyModel:
    """Mixin of a stack family's ``PreTrainedModel``: the plan and the class flags derived from ``stack_spec``. The
    family declares ``stack_spec`` and, once its base model class exists, ``base_model_class``.

    A class that sets a ``stack_spec`` with parts gets ``_no_split_modules`` (``StackSpec.no_split_modules``: the
    block, after an encoder's embeddings class), ``_can_record_outputs`` (``StackSpec.recorded_outputs``: the block's
    outputs as ``hidden_states``, the attention component's as ``attentions``, the spec's ``outputs``) and the
    ``_supports_<kernel>`` flags (``StackSpec.attention_kernels``) unless it sets them itself (GPT-2 records through
    ``OutputRecorder``s; the MoE decoders add their routers with ``record_outputs``)."""

    parallel_plan = _DerivedPlan()
    head_styles: dict = {}
    #: recorders added to the derived ``_can_record_outputs`` (the MoE decoders' ``router_logits``)
    record_outputs: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "stack_spec" not in own and "record_outputs" not in own:
            return
        spec = cls.stack_spec
        if not spec.parts:  # a family that builds its own modules states its flags
            return
        if "_no_split_modules" not in own:
            cls._no_split_modules = spec.no_split_modules
        if "_can_record_outputs" not in own:
            cls._can_record_outputs = {**spec.recorded_outputs, **cls.record_outputs}
        for kernel in ("sdpa", "flash_attn", "flex_attn", "attention_backend"):
            if f"_supports_{kernel}" not in own:
                setattr(cls, f"_supports_{kernel}", kernel in spec.attention_kernels)

    @classmethod
    def stack_options(cls, config):
        """The frozen options of ``config`` every part and layer of the base model is built with (``None``: the
        family has no switches beyond its config; the Llama-shaped decoders: ``DecoderOptions``)."""
        return None

    @classmethod
    def head_hidden_size(cls, config) -> int:
        """The width of the base model's output, which the heads read (OPT: ``word_embed_proj_dim``)."""
        return config.hidden_size
    #: ``base_model_class``: the family's base model, declared by the family's ``PreTrainedModel`` (not here: this
    #: mixin precedes it in the method resolution order)


class HeadModel(StackFamilyModel):
    """A head on ``base_model_class``, registered under ``base_model_prefix`` as ``transformers``' generic heads do
    (``GenericFor*`` in ``transformers.modeling_layers``). Subclasses build their head modules in
    ``build_head(config)`` and compute their output from ``base_outputs``."""

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        setattr(self, self.base_model_prefix,
                self.base_model_class(config, parallel_context=self.parallel_context, submodule=True))
        self.build_head(config)
        self.post_init()
        self.finish_init()

    def build_head(self, config) -> None:
        raise NotImplementedError

    def get_input_embeddings(self):
        return self.base_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.base_model.set_input_embeddings(value)

    def base_outputs(self, input_ids=None, **kwargs):
        kwargs.pop("return_dict", None)  # the head decides (``can_return_tuple``); the base answers a dict
        return self.base_model(input_ids, return_dict=True, **kwargs)


class ForCausalLM(HeadModel):
    """The stack with an LM head (tied to the input embedding when ``tie_word_embeddings``). Under TP the head is
    vocab-parallel and the loss runs on the vocab-split logits (``causal_lm_loss``); ``logits`` are gathered to
    ``[b, s, V]`` unless ``gather_logits=False`` (then this rank's ``[b, s, V_padded/tp]``), and are ``None`` with
    ``skip_logits=True`` (the fused, chunked loss: ``common/loss/lm_loss.py``). Pipeline stages: derived from the spec
    (``common/pipeline/pipeline_stack.py``). A family declares ``class XForCausalLM(ForCausalLM, XPreTrainedModel,
    GenerationMixin)``: ``GenerationMixin`` after the ``PreTrainedModel``, as ``transformers`` requires, so
    ``OsloPreTrainedModel.generate`` (the tensor-parallel sampling RNG) wraps its ``generate``."""

    head_styles = {"lm_head": Colwise(vocab=True)}
    pipeline_adapter = _DerivedPipelineAdapter()
    pipeline_adapter_class = StackPipelineAdapter
    output_class = CausalLMOutputWithPast
    capabilities = Capabilities(context_parallel=True)
    _tied_weights_keys = _DerivedTiedKeys()
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    #: whether its pipeline stages run under the 2D / 2.5D / 3D tensor-parallel modes (tested for GPT-2)
    pipeline_grid_modes = False
    #: whether ``lm_head`` has a bias (GPT-J, Phi; vocab-parallel like the weight, zero on the padded rows)
    lm_head_bias = False

    def build_head(self, config) -> None:
        self.lm_head = Linear(self.head_hidden_size(config), config.vocab_size, bias=self.lm_head_bias)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def final_logit_softcap(self) -> float | None:
        """``c`` of the soft-cap ``c * tanh(logits / c)`` on the logits before the loss, also on the pipeline's last
        stage: ``config.final_logit_softcapping`` (Gemma 2/3; every ``transformers`` causal LM whose config has
        the attribute applies it), ``None`` without one."""
        return getattr(self.config, "final_logit_softcapping", None)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, gather_logits: bool = True,
                num_items_in_batch=None, shift_labels=None, skip_logits: bool = False, **kwargs):
        outputs = self.base_outputs(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                    use_cache=use_cache, **kwargs)
        loss, logits = causal_lm_head_outputs(self, outputs.last_hidden_state, labels, logits_to_keep=logits_to_keep,
                                              gather_logits=gather_logits, num_items_in_batch=num_items_in_batch,
                                              shift_labels=shift_labels, skip_logits=skip_logits,
                                              logit_softcap=self.final_logit_softcap())
        # cross-attentions where the output class has them (GPT-2's, as transformers: recorded, empty)
        extra = {key: outputs[key] for key in ("cross_attentions",)
                 if key in outputs and key in self.output_class.__dataclass_fields__}
        return self.output_class(loss=loss, logits=logits, **cache_field(output_cache(outputs)),
                                 **passed_on(outputs), **extra)


class ForSequenceClassification(HeadModel):
    """Replicated ``score`` read at each row's last non-padding token (as ``transformers``): ``[b, num_labels]``.
    Under context parallelism the token's row comes from the cp rank holding it (``context_parallel.
    last_token_logits``): every rank returns the whole ``[b, num_labels]`` and the same loss."""

    capabilities = Capabilities(context_parallel=True)

    def build_head(self, config) -> None:
        self.num_labels = config.num_labels
        self.score = Linear(self.head_hidden_size(config), config.num_labels, bias=False)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, **kwargs) -> SequenceClassifierOutputWithPast:
        outputs = self.base_outputs(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                    use_cache=use_cache, **kwargs)
        pool = last_token_logits if self.parallel_context.cp_size == 1 else partial(cp.last_token_logits, self)
        logits = pool(self.score(outputs.last_hidden_state), input_ids, self.config.pad_token_id)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return SequenceClassifierOutputWithPast(loss=loss, logits=logits, **cache_field(output_cache(outputs)),
                                                **passed_on(outputs))


class ForTokenClassification(HeadModel):
    """Replicated classifier (after ``dropout``) on every token: ``logits [b, s, num_labels]``. ``classifier_name``
    is ``transformers``' attribute (``score``; GPT-2: ``classifier``). Under context parallelism ``logits`` are this
    rank's chunk(s) and the loss is the mean over the whole sequence (``context_parallel.token_loss``)."""

    classifier_name = "score"
    capabilities = Capabilities(context_parallel=True)

    def build_head(self, config) -> None:
        self.num_labels = config.num_labels
        dropout = next((value for value in (getattr(config, "classifier_dropout", None),
                                            getattr(config, "hidden_dropout", None)) if value is not None), 0.1)
        self.dropout = Dropout(dropout)
        setattr(self, self.classifier_name, Linear(self.head_hidden_size(config), config.num_labels,
                                                   bias=getattr(config, "token_classification_bias", True)))

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, num_items_in_batch=None,
                **kwargs) -> TokenClassifierOutput:
        outputs = self.base_outputs(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                    use_cache=use_cache, **kwargs)
        classifier = getattr(self, self.classifier_name)
        logits = classifier(self.dropout(outputs.last_hidden_state))
        if self.parallel_context.cp_size > 1:
            loss = cp.token_loss(self, logits, labels, num_items_in_batch) if labels is not None else None
            return TokenClassifierOutput(loss=loss, logits=logits, **passed_on(outputs))
        return token_classification_output(logits, labels, outputs, num_items_in_batch)


class ForQuestionAnswering(HeadModel):
    """Replicated span head ``qa_outputs``: ``start_logits, end_logits [b, s]``. Under context parallelism the
    ``[b, s_local, 2]`` logits are gathered to the whole sequence first (``context_parallel.gather_over_context``,
    ``2 * b * s`` values): every rank returns the whole ``[b, s]`` logits and the same loss."""

    capabilities = Capabilities(context_parallel=True)

    def build_head(self, config) -> None:
        self.qa_outputs = Linear(self.head_hidden_size(config), 2)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, start_positions=None, end_positions=None, **kwargs):
        kwargs.pop("use_cache", None)
        outputs = self.base_outputs(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=False,
                                    **kwargs)
        logits = cp.gather_over_context(self, self.qa_outputs(outputs.last_hidden_state))
        return question_answering_output(logits, start_positions, end_positions, outputs)
