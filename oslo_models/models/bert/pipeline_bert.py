"""BERT-like encoder heads as pipeline stages (see ``oslo_models/pipeline/adapter.py``): one adapter per head kind,
bound to the head class (``of(model_class)``), so RoBERTa and its variants get theirs from the same code.

A stage runs the base model's own phases (``stack_inputs``, ``run_stack``: ``common/pipeline_stack.py``'s
``run_stage_stack``) on its layers, exactly what ``BertModel.forward`` runs: the first stage the embeddings (word +
position + token type, LayerNorm, dropout; RoBERTa's position ids come from its ``input_ids``) and the
sequence-parallel scatter, every stage the bidirectional mask and its layers, the last stage the gather back and the
head. Between stages flows one tensor, the hidden states ``[mb, s, h]`` (``[mb, s/tp, h]`` under sequence
parallelism, each TP rank sending its own slice to the same TP rank of the next stage).

Off the first stage the embedding *parts* are dropped (the empty ``embeddings`` container stays, so
``get_input_embeddings()`` reads ``None``, as GPT-2's does off the first stage); off the last stage the whole
head module is dropped (``cls`` / ``lm_head``; ``bert.pooler`` and ``classifier`` for sequence classification).
Parameter counts per layer, for the partitioner, come from the head class built on the meta device with no
parallelism, not from formulas.

A head class may carry its own rule instead of the adapter's (DeBERTa's ``ContextPooler``, ModernBERT's pooling,
ELECTRA's ``sequence_summary``): ``pipeline_head_modules`` (``{attribute: module path}`` of the modules it reads) and
``head_logits(holder, hidden, attention_mask, config)``, which its own ``forward`` runs on the model and the last stage
runs on itself (holding those modules under the same attribute names), so one rule serves both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...distributed.context import ParallelContext
from ...pipeline.adapter import PipelineAdapter
from ..common import token_loss, use_sequence_parallel
from ..common.pipeline_stack import run_stage_stack
from ..heads import sequence_classification_loss

EMBEDDING_PARTS = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm", "dropout")


class EncoderPipelineAdapter(PipelineAdapter):
    """The encoder stages shared by every BERT-like head. Subclasses name the head: ``head_modules_of`` (attribute
    on the last ``StageModule`` -> module path; the outermost ones are dropped off the last stage),
    ``head_forward``, ``head_output_shape`` and ``loss``."""

    model_class: type = None  # the head model class (``of``)
    base = "bert"  # the encoder's ``base_model_prefix``
    batch_keys = ("input_ids", "labels", "attention_mask", "token_type_ids", "position_ids")
    head_modules: dict[str, str] = {}

    @classmethod
    def of(cls, model_class: type) -> type:
        base = model_class.base_model_prefix
        own = getattr(model_class, "pipeline_head_modules", None)  # the head class's own rule (module docstring)
        body = dict(model_class=model_class, base=base, layer_paths=(f"{base}.{model_class.stack_spec.layers}",),
                    head_modules=dict(own) if own is not None else cls.head_modules_of(model_class))
        return type(f"{model_class.__name__}PipelineAdapter", (cls,), body)

    @classmethod
    def head_modules_of(cls, model_class: type) -> dict[str, str]:
        raise NotImplementedError

    # ------------------------------------------------------------------ structure
    def layer_counts(self, model) -> tuple[int, ...]:
        return (model.config.num_hidden_layers,)

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Each layer's parameters, the embeddings' (first stage) and the head's (last stage; a tied decoder counts
        its full ``vocab x h``: the last stage holds a copy), counted on the head class built on the meta device."""
        with torch.device("meta"):
            plain = self.model_class(model.config, parallel_context=ParallelContext.single_process())

        def count(*modules) -> float:
            return float(sum({id(p): p.numel() for m in modules for p in m.parameters()}.values()))

        base = getattr(plain, self.base)
        costs = [count(layer) for layer in plain.get_submodule(self.layer_paths[0])]
        head = [plain.get_submodule(path) for path in self._outermost(set(self.head_modules.values()))]
        extras = [base.get_submodule(path) for path in self._embedding_extras(model)]
        return costs, count(base.embeddings, *extras), count(*head)

    def _embedding_extras(self, model) -> tuple[str, ...]:
        """Modules of the base model the embedding phase runs besides ``embeddings`` (ELECTRA's
        ``embeddings_project``), relative to the base model; none for a base model without the hook (DeBERTa)."""
        extras = getattr(self.model_class.base_model_class, "embedding_extras", None)
        return extras(model.config) if extras is not None else ()

    def _embedding_modules(self, model) -> dict[str, str]:
        # The container runs the forward; its parts are listed so that they are kept here and dropped elsewhere.
        path = f"{self.base}.embeddings"
        embeddings = model.get_submodule(path)  # DistilBERT's have no token types
        parts = [part for part in EMBEDDING_PARTS if hasattr(embeddings, part)]
        return {"embeddings": path, **{f"embeddings_{part}": f"{path}.{part}" for part in parts},
                **{f"embeddings_extra_{i}": f"{self.base}.{extra}"
                   for i, extra in enumerate(self._embedding_extras(model))}}

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        modules = self._embedding_modules(model) if stage == 0 else {}
        if stage == layout.num_stages - 1:
            modules.update(self.head_modules)
        return modules

    @staticmethod
    def _outermost(paths: set[str]) -> set[str]:
        return {path for path in paths if not any(path.startswith(outer + ".") for outer in paths)}

    def optional_modules(self, model, layout) -> set[str]:
        """The embedding parts and the outermost head modules (a module inside a dropped one goes with it)."""
        parts = set(self._embedding_modules(model).values()) - {f"{self.base}.embeddings"}
        return self._outermost(parts | set(self.head_modules.values()))

    # ------------------------------------------------------------------ batches and shapes
    def use_sequence_parallel(self, model, batch) -> bool:
        return use_sequence_parallel(model, batch["input_ids"].shape[-1])

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        mb, seq_len = microbatch["input_ids"].shape
        return self.hidden_state_io(model, layout, stage, microbatch, sequence_parallel,
                                    lambda: self.head_output_shape(model, mb, seq_len))

    # ------------------------------------------------------------------ compute
    def stage_forward(self, stage, x, attention_mask=None, token_type_ids=None, position_ids=None):
        # token_type_ids / position_ids reach every stage; only the first stage's embeddings read them
        hidden = run_stage_stack(getattr(stage.owner, self.base), stage, x, attention_mask, position_ids,
                                 token_type_ids=token_type_ids)
        if not stage.is_last:
            return hidden
        if getattr(self.model_class, "pipeline_head_modules", None) is not None:  # the head class's own rule
            return self.model_class.head_logits(stage, hidden, attention_mask, stage.model_config)
        return self.head_forward(stage, hidden)

    # ------------------------------------------------------------------ the head (subclasses)
    def head_forward(self, stage, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's output from the full-sequence hidden states ``[mb, s, h]``."""
        raise NotImplementedError

    def head_output_shape(self, model, mb: int, seq_len: int) -> tuple[int, ...]:
        """The shape of ``head_forward``'s output for a microbatch of ``mb`` sequences of ``seq_len`` tokens."""
        raise NotImplementedError


class MaskedLMPipelineAdapter(EncoderPipelineAdapter):
    """Masked LM: the last stage runs the MLM head (the head class's replicated transform ``mlm_transform`` over the
    modules it names, then the vocab-parallel decoder at ``mlm_decoder_path()``, tied to the word embeddings) ->
    local logits ``[mb, s, V_padded/tp]``; the loss runs on the split vocabulary (no shift, ``-100`` ignored), as
    ``ForMaskedLM.forward``'s."""

    decoder_path = "cls.predictions.decoder"  # the vocab-parallel decoder

    @classmethod
    def of(cls, model_class: type) -> type:
        adapter = super().of(model_class)
        adapter.decoder_path = model_class.mlm_decoder_path()
        return adapter

    @classmethod
    def head_modules_of(cls, model_class):
        # the transform's modules under the model's names (``mlm_transform`` runs on the stage), the decoder under
        # "decoder"; the outermost head modules are dropped off the last stage
        names = model_class.mlm_head_module_names()
        return {**{name: name for name in names}, "decoder": model_class.mlm_decoder_path()}

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        if getattr(model.config, "tie_word_embeddings", False):
            return [(f"{self.base}.embeddings.word_embeddings.weight", f"{self.decoder_path}.weight")]
        return []

    def head_forward(self, stage, hidden):
        # the model class's transform, run on the stage (which holds its modules under the same names)
        return stage.decoder(self.model_class.mlm_transform(stage, hidden))  # [mb, s, V_padded/tp]

    def head_output_shape(self, model, mb, seq_len):
        return mb, seq_len, model.get_submodule(self.decoder_path).weight.shape[0]

    def loss(self, model, local_logits, labels, num_items_in_batch):
        return token_loss(local_logits, labels, model.get_submodule(self.decoder_path),
                          num_items_in_batch=num_items_in_batch)


class SequenceClassificationPipelineAdapter(EncoderPipelineAdapter):
    """Sequence classification on the pooled ``[CLS]`` state: the last stage runs the pooler, dropout and the
    replicated ``classifier`` -> ``logits [mb, num_labels]``; the loss is the model's (``config.problem_type``),
    turned from the microbatch mean into its share of the whole batch's mean."""

    @classmethod
    def head_modules_of(cls, model_class):
        if model_class.head_class is not None:  # its own classifier module on the hidden states (RoBERTa, ELECTRA)
            return {"classifier": "classifier"}
        if hasattr(model_class, "first_token_logits"):  # DistilBERT: pre_classifier on the first token
            return {"pre_classifier": "pre_classifier", "dropout": "dropout", "classifier": "classifier"}
        return {"pooler": f"{model_class.base_model_prefix}.pooler", "dropout": "dropout", "classifier": "classifier"}

    def head_forward(self, stage, hidden):
        if self.model_class.head_class is not None:
            return stage.classifier(hidden)
        if hasattr(self.model_class, "first_token_logits"):  # the model's rule, run on the stage's modules
            return self.model_class.first_token_logits(stage, hidden)
        return stage.classifier(stage.dropout(stage.pooler(hidden)))

    def head_output_shape(self, model, mb, seq_len):
        return mb, model.config.num_labels

    def num_loss_items(self, labels: torch.Tensor) -> int:
        """What the model's mean runs over: labels other than ``-100`` (class indices) or every value (regression,
        multi-label targets)."""
        return int((labels != -100).sum()) if not labels.is_floating_point() else labels.numel()

    def loss(self, model, logits, labels, num_items_in_batch):
        items = self.num_loss_items(labels)
        if not items:  # every label of this microbatch ignored: it adds nothing (the mean would be NaN)
            return logits.sum() * 0.0
        return sequence_classification_loss(logits, labels, model.config) * (items / num_items_in_batch)


class TokenClassificationPipelineAdapter(EncoderPipelineAdapter):
    """Token classification: the last stage runs the replicated ``dropout`` and ``classifier`` on every token ->
    ``logits [mb, s, num_labels]``; the loss is the model's cross-entropy (``-100`` ignored) as this microbatch's
    summed token losses over the whole batch's labelled tokens."""

    @classmethod
    def head_modules_of(cls, model_class):
        return {"dropout": "dropout", "classifier": "classifier"}

    def head_forward(self, stage, hidden):
        return stage.classifier(stage.dropout(hidden))

    def head_output_shape(self, model, mb, seq_len):
        return mb, seq_len, model.config.num_labels

    def loss(self, model, logits, labels, num_items_in_batch):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
                               ) / num_items_in_batch


class QuestionAnsweringPipelineAdapter(EncoderPipelineAdapter):
    """Extractive QA: the last stage runs the replicated span head ``qa_outputs`` -> ``[mb, s, 2]`` (start, end).

    The batch takes ``start_positions`` / ``end_positions`` (``[b]``); ``prepare_batch`` turns them into the
    ``labels [b, 2]`` the schedule hands the loss: clamped to ``[0, s]`` as ``transformers`` does, ``s`` (outside
    the sequence: ignored there) written ``-100``. ``transformers``' loss is the mean of the start and the end
    cross-entropies, each a mean over its own non-ignored rows; a microbatch's share is exact when both counts are
    equal (``(sum_start + sum_end) / (2 n)``), so a batch whose start and end counts differ is refused."""

    batch_keys = EncoderPipelineAdapter.batch_keys + ("start_positions", "end_positions")

    @classmethod
    def head_modules_of(cls, model_class):
        # DistilBERT's span head runs a dropout first (``span_dropout``)
        return {"qa_outputs": "qa_outputs", **({"dropout": "dropout"} if model_class.span_dropout else {})}

    def prepare_batch(self, model, batch):
        if "start_positions" not in batch or "end_positions" not in batch:
            raise ValueError("A pipelined question-answering step takes start_positions and end_positions")
        seq_len = self.span_length(batch)
        positions = torch.stack([batch.pop("start_positions").reshape(-1), batch.pop("end_positions").reshape(-1)],
                                dim=-1).clamp(0, seq_len)
        labels = positions.masked_fill(positions == seq_len, -100)
        counts = (labels != -100).sum(0)
        if counts[0] != counts[1]:
            raise ValueError(f"A pipelined question-answering step needs as many start as end positions inside the "
                             f"sequence (got {int(counts[0])} and {int(counts[1])}): transformers averages each "
                             f"over its own rows, which microbatches cannot split exactly otherwise")
        batch["labels"] = labels
        return batch

    def span_length(self, batch) -> int:
        """The length the span logits have (positions past it are ignored)."""
        return batch["input_ids"].shape[-1]

    def head_forward(self, stage, hidden):
        return stage.qa_outputs(stage.dropout(hidden) if self.model_class.span_dropout else hidden)

    def head_output_shape(self, model, mb, seq_len):
        return mb, seq_len, 2

    def num_loss_items(self, labels: torch.Tensor) -> int:
        return int((labels[:, 0] != -100).sum())

    def loss(self, model, logits, labels, num_items_in_batch):
        start, end = (F.cross_entropy(logits[..., i], labels[:, i], reduction="sum") for i in (0, 1))
        return (start + end) / (2 * num_items_in_batch)


class MultipleChoicePipelineAdapter(SequenceClassificationPipelineAdapter):
    """Multiple choice: the batch's ``[b, c, s]`` tensors are flattened to ``[b*c, s]`` before the split, as
    ``transformers`` flattens them (``prepare_batch``), so a microbatch of ``b/m`` questions holds their ``c`` choices
    whole (consecutive rows); the stages run ``mb*c`` sequences. The last stage scores each one with the head's
    pooled rule (``[mb*c, 1]``: BERT's pooler, DistilBERT's first-token classifier, or the head class's own); the loss
    views them as ``[mb, c]`` and is the cross-entropy over the choices (``-100`` ignored) as this microbatch's share
    of the whole batch's mean."""

    input_ids_dims = 3
    choice_keys = ("input_ids", "attention_mask", "token_type_ids", "position_ids")

    @classmethod
    def head_modules_of(cls, model_class):
        if hasattr(model_class, "first_token_logits"):  # DistilBERT: pre_classifier on the first token
            return {"pre_classifier": "pre_classifier", "dropout": "dropout", "classifier": "classifier"}
        return {"pooler": f"{model_class.base_model_prefix}.pooler", "dropout": "dropout", "classifier": "classifier"}

    def head_forward(self, stage, hidden):
        if hasattr(self.model_class, "first_token_logits"):
            return self.model_class.first_token_logits(stage, hidden)
        return stage.classifier(stage.dropout(stage.pooler(hidden)))

    def prepare_batch(self, model, batch):
        for key in self.choice_keys:
            if key in batch:
                batch[key] = batch[key].reshape(-1, batch[key].shape[-1])
        return batch

    def head_output_shape(self, model, mb, seq_len):
        return mb, 1  # mb: the microbatch's flattened choices

    def loss(self, model, logits, labels, num_items_in_batch):
        return F.cross_entropy(logits.view(labels.shape[0], -1), labels, reduction="sum") / num_items_in_batch
