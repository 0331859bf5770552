"""One rule per task head, read by the model's ``forward`` and by a pipeline's last stage alike.

A rule (one instance per task: :data:`MASKED_LM`, :data:`SEQUENCE_CLASSIFICATION`, :data:`TOKEN_CLASSIFICATION`,
:data:`QUESTION_ANSWERING`, :data:`MULTIPLE_CHOICE`, :data:`SEQ2SEQ_LM`) says for its task:

- ``modules(model_class)``: the head's modules as ``{attribute: module path in the model}``; a pipeline's last
  stage holds them under those attributes, and :class:`HeadParts` shows the model's own under the same names;
- ``logits(model_class, holder, hidden, ...)``: the head's output from the full-sequence hidden states ``[b, s, h]``
  of the base model, computed on ``holder`` (the stage, or ``HeadParts`` of the model): the same code for both;
- ``output_shape``, ``prepare_batch`` (positions into labels, flattened choices), the extra batch keys, and the loss
  of one microbatch as its share of the whole batch's loss (``loss(model, logits, labels, num_items_in_batch)``,
  with ``num_items_in_batch`` the count ``loss_items`` gives summed over the batch).

A head class may carry its own logits rule instead of the task's default (DeBERTa's ``ContextPooler``, ModernBERT's
pooling, ELECTRA's ``sequence_summary``): ``pipeline_head_modules`` (``{attribute: module path}``) and
``head_logits(holder, hidden, attention_mask, config)``. The family's pooling hook ``pool(holder, hidden)`` with
``pooler_modules()`` (ALBERT's ``pooler`` + ``pooler_activation``) and DistilBERT's ``first_token_logits(holder,
hidden)`` are the other per-family variations. No collective runs here: the heads are replicated, except the masked
LM's decoder, whose loss runs on the vocab-split logits (``token_loss``: all-reduces over tensor parallelism).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .lm_loss import token_loss


class HeadParts:
    """The head modules of ``model`` under the attribute names a pipeline's last stage holds them by
    (``{attribute: module path}``), so a rule runs on the model as on the stage."""

    def __init__(self, model, modules: dict[str, str]):
        self.__dict__.update(_model=model, _paths=modules)

    def __getattr__(self, name):
        if name not in self._paths:
            raise AttributeError(name)
        return self._model.get_submodule(self._paths[name])


def own_rule(model_class) -> bool:
    """Whether the head class carries its own logits rule (``pipeline_head_modules`` and ``head_logits``)."""
    return getattr(model_class, "pipeline_head_modules", None) is not None


class HeadRule:
    """The defaults (token-level ``-100``-ignoring items); each task overrides what differs."""

    extra_batch_keys: tuple[str, ...] = ()
    input_ids_dims = 2

    def modules(self, model_class) -> dict[str, str]:
        return dict(model_class.pipeline_head_modules) if own_rule(model_class) else self.task_modules(model_class)

    def task_modules(self, model_class) -> dict[str, str]:
        raise NotImplementedError

    def logits(self, model_class, holder, hidden, attention_mask=None, config=None, pooled=None):
        """``pooled``: the base model's pooled output when the caller has it (the model's forward), else ``None``
        (the stage computes it from ``hidden``)."""
        if own_rule(model_class):
            return model_class.head_logits(holder, hidden, attention_mask, config)
        return self.task_logits(model_class, holder, hidden, pooled)

    def task_logits(self, model_class, holder, hidden, pooled):
        raise NotImplementedError

    def output_shape(self, model, mb: int, seq_len: int) -> tuple[int, ...]:
        raise NotImplementedError

    def prepare_batch(self, model, batch: dict, span_key: str = "input_ids") -> dict:
        return batch

    def num_loss_items(self, labels: torch.Tensor) -> int:
        return int((labels != -100).sum())

    def loss_items(self, model, labels: torch.Tensor) -> int:
        return self.num_loss_items(labels)

    def tied_groups(self, model, word_embeddings: str) -> list[tuple[str, ...]]:
        return []


class MaskedLMRule(HeadRule):
    """The head class's replicated transform ``mlm_transform`` over the modules of ``mlm_head_module_names()``, then
    the vocab-parallel decoder at ``mlm_decoder_path()`` -> local logits ``[b, s, V_padded/tp]``; the loss on the
    split vocabulary, no shift, ``-100`` ignored (the model's forward runs the same transform, then the fused or
    plain ``head_loss_and_logits``)."""

    def task_modules(self, model_class):
        return {**{name: name for name in model_class.mlm_head_module_names()},
                "decoder": model_class.mlm_decoder_path()}

    def task_logits(self, model_class, holder, hidden, pooled):
        return holder.decoder(model_class.mlm_transform(holder, hidden))

    def output_shape(self, model, mb, seq_len):
        return mb, seq_len, model.get_submodule(type(model).mlm_decoder_path()).weight.shape[0]

    def loss(self, model, local_logits, labels, num_items_in_batch):
        return token_loss(local_logits, labels, model.get_submodule(type(model).mlm_decoder_path()),
                          num_items_in_batch=num_items_in_batch)

    def tied_groups(self, model, word_embeddings):
        if getattr(model.config, "tie_word_embeddings", False):
            return [(word_embeddings, f"{type(model).mlm_decoder_path()}.weight")]
        return []


class PooledRule(HeadRule):
    """A score from the pooled first token: DistilBERT's ``first_token_logits``, else ``classifier(dropout(pool))``
    with the family's pooling (``pool``/``pooler_modules``; BERT's ``pooler``)."""

    def task_modules(self, model_class):
        if hasattr(model_class, "first_token_logits"):
            return {"pre_classifier": "pre_classifier", "dropout": "dropout", "classifier": "classifier"}
        return {**model_class.pooler_modules(), "dropout": "dropout", "classifier": "classifier"}

    def task_logits(self, model_class, holder, hidden, pooled):
        if hasattr(model_class, "first_token_logits"):
            return model_class.first_token_logits(holder, hidden)
        return holder.classifier(holder.dropout(model_class.pool(holder, hidden) if pooled is None else pooled))


class SequenceClassificationRule(PooledRule):
    """``logits [b, num_labels]``: a head module of its own on the hidden states (``head_class``: RoBERTa's, ELECTRA's
    ``classifier``), or the pooled score; the loss is the model's (``config.problem_type``), turned from the
    microbatch mean into its share of the whole batch's mean."""

    def task_modules(self, model_class):
        return {"classifier": "classifier"} if model_class.head_class is not None else super().task_modules(model_class)

    def task_logits(self, model_class, holder, hidden, pooled):
        if model_class.head_class is not None:
            return holder.classifier(hidden)
        return super().task_logits(model_class, holder, hidden, pooled)

    def output_shape(self, model, mb, seq_len):
        return mb, model.config.num_labels

    def num_loss_items(self, labels):
        """Labels other than ``-100`` (class indices) or every value (regression, multi-label targets)."""
        return int((labels != -100).sum()) if not labels.is_floating_point() else labels.numel()

    def classification_loss(self, logits, labels, config):
        from ...heads import sequence_classification_loss

        return sequence_classification_loss(logits, labels, config)

    def loss(self, model, logits, labels, num_items_in_batch):
        items = self.loss_items(model, labels)
        if not items:  # every label of this microbatch ignored: it adds nothing (the mean would be NaN)
            return logits.sum() * 0.0
        return self.classification_loss(logits, labels, model.config) * (items / num_items_in_batch)


class TokenClassificationRule(HeadRule):
    """``classifier(dropout(h))`` on every token -> ``[b, s, num_labels]``; the summed cross-entropy (``-100``
    ignored) over the whole batch's labelled tokens."""

    def task_modules(self, model_class):
        return {"dropout": "dropout", "classifier": "classifier"}

    def task_logits(self, model_class, holder, hidden, pooled):
        return holder.classifier(holder.dropout(hidden))

    def output_shape(self, model, mb, seq_len):
        return mb, seq_len, model.config.num_labels

    def loss(self, model, logits, labels, num_items_in_batch):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
                               ) / num_items_in_batch


class QuestionAnsweringRule(HeadRule):
    """``qa_outputs`` (after ``dropout`` where ``span_dropout``: DistilBERT) -> ``[b, s, 2]`` (start, end).

    ``prepare_batch`` turns ``start_positions`` / ``end_positions`` (``[b]``) into ``labels [b, 2]``: clamped to
    ``[0, s]`` as ``transformers`` does (``s`` = the length of ``batch[span_key]``), ``s`` written ``-100``.
    ``transformers``' loss is the mean of the start and end cross-entropies, each over its own non-ignored rows; a
    microbatch's share is exact when both counts are equal, so a batch whose counts differ is refused."""

    extra_batch_keys = ("start_positions", "end_positions")

    def task_modules(self, model_class):
        return {"qa_outputs": "qa_outputs", **({"dropout": "dropout"} if model_class.span_dropout else {})}

    def task_logits(self, model_class, holder, hidden, pooled):
        return holder.qa_outputs(holder.dropout(hidden) if model_class.span_dropout else hidden)

    def output_shape(self, model, mb, seq_len):
        return mb, seq_len, 2

    def prepare_batch(self, model, batch, span_key="input_ids"):
        if "start_positions" not in batch or "end_positions" not in batch:
            raise ValueError("A pipelined question-answering step takes start_positions and end_positions")
        seq_len = batch[span_key].shape[-1]
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

    def num_loss_items(self, labels):
        return int((labels[:, 0] != -100).sum())

    def loss(self, model, logits, labels, num_items_in_batch):
        start, end = (F.cross_entropy(logits[..., i], labels[:, i], reduction="sum") for i in (0, 1))
        return (start + end) / (2 * num_items_in_batch)


class MultipleChoiceRule(PooledRule):
    """``[b, c, s]`` inputs flattened to ``[b*c, s]`` before the split (``prepare_batch``), so a microbatch holds its
    questions' choices whole; one pooled score per flattened choice ``[b*c, 1]``, viewed as ``[b, c]`` by the loss:
    the cross-entropy over the choices (``-100`` ignored) as this microbatch's share of the whole batch's mean."""

    input_ids_dims = 3
    choice_keys = ("input_ids", "attention_mask", "token_type_ids", "position_ids")

    def output_shape(self, model, mb, seq_len):
        return mb, 1

    def prepare_batch(self, model, batch, span_key="input_ids"):
        for key in self.choice_keys:
            if key in batch:
                batch[key] = batch[key].reshape(-1, batch[key].shape[-1])
        return batch

    def loss(self, model, logits, labels, num_items_in_batch):
        return F.cross_entropy(logits.view(labels.shape[0], -1), labels, reduction="sum") / num_items_in_batch


class Seq2SeqLMRule(HeadRule):
    """An encoder-decoder's LM head ``lm_head`` on the decoder output -> local logits ``[b, s_dec, V_padded/tp]``; the
    loss on the split vocabulary, labels not shifted (the decoder inputs are), ``-100`` ignored: the summed token
    losses over ``num_items_in_batch`` (BART's ``forward`` and the pipeline's last stage)."""

    def task_modules(self, model_class):
        return {"lm_head": "lm_head"}

    def output_shape(self, model, mb, seq_len):
        return mb, seq_len, model.lm_head.weight.shape[0]

    def loss(self, model, local_logits, labels, num_items_in_batch):
        return token_loss(local_logits, labels, model.lm_head, num_items_in_batch=num_items_in_batch)


MASKED_LM = MaskedLMRule()
SEQUENCE_CLASSIFICATION = SequenceClassificationRule()
TOKEN_CLASSIFICATION = TokenClassificationRule()
QUESTION_ANSWERING = QuestionAnsweringRule()
MULTIPLE_CHOICE = MultipleChoiceRule()
SEQ2SEQ_LM = Seq2SeqLMRule()


class RuleLoss:
    """A pipeline adapter's last-stage loss read from its task's ``rule`` (a ``HeadRule``): the adapters of every
    family (encoder, encoder-decoder) share these three answers."""

    rule: HeadRule

    def num_loss_items(self, labels):
        return self.rule.num_loss_items(labels)

    def loss_items(self, model, labels):
        return self.rule.loss_items(model, labels)

    def loss(self, model, outputs, labels, num_items_in_batch):
        return self.rule.loss(model, outputs, labels, num_items_in_batch)
