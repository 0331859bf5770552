"""BERT (and RoBERTa, through a subclass) as pipeline stages (see ``oslo_models/pipeline/adapter.py``).

First stage: the embeddings module (word + position + token type, LayerNorm, dropout; RoBERTa's position ids
come from its ``input_ids``), then the sequence-parallel scatter; layers ``bert.encoder.layer``; last stage: the
sequence-parallel gather, then the head. Every stage builds the bidirectional mask from the 2-D
``attention_mask`` as ``BertModel.forward`` does. Between stages flows one tensor, the hidden states
``[mb, s, h]`` (``[mb, s/tp, h]`` under sequence parallelism, each TP rank sending its own slice to the same TP
rank of the next stage).

Off the first stage the embedding *parts* are dropped (the empty ``embeddings`` container stays, so
``get_input_embeddings()`` reads ``None``, as GPT-2's does off the first stage); off the last stage the whole
head module is dropped (``cls`` / ``lm_head``; ``bert.pooler`` and ``classifier`` for sequence classification).
"""
from __future__ import annotations

import torch
from transformers.masking_utils import create_bidirectional_mask

from ...pipeline.adapter import PipelineAdapter
from ..common import enter_sequence_parallel, leave_sequence_parallel, token_loss, use_sequence_parallel
from ..heads import sequence_classification_loss

EMBEDDING_PARTS = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm", "dropout")


class BertPipelineAdapter(PipelineAdapter):
    """The encoder stages shared by every BERT-like head. Subclasses name the head: ``head_modules`` (attribute
    on the last ``StageModule`` -> module path; the outermost ones are dropped off the last stage),
    ``head_forward``, ``head_output_shape``, ``head_parameter_count`` and ``loss``."""

    base = "bert"  # the encoder's ``base_model_prefix``
    layer_paths = ("bert.encoder.layer",)
    batch_keys = ("input_ids", "labels", "attention_mask", "token_type_ids", "position_ids")
    head_modules: dict[str, str] = {}

    # ------------------------------------------------------------------ structure
    def layer_counts(self, model) -> tuple[int, ...]:
        return (model.config.num_hidden_layers,)

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        config = model.config
        h, inner = config.hidden_size, config.intermediate_size
        layer = 4 * (h * h + h) + (h * inner + inner) + (inner * h + h) + 2 * 2 * h  # q k v o, FFN, two norms
        embeddings = (config.vocab_size + config.max_position_embeddings + config.type_vocab_size) * h + 2 * h
        return [float(layer)] * config.num_hidden_layers, float(embeddings), float(self.head_parameter_count(config))

    def _embedding_modules(self) -> dict[str, str]:
        # The container runs the forward; its parts are listed so that they are kept here and dropped elsewhere.
        path = f"{self.base}.embeddings"
        return {"embeddings": path, **{f"embeddings_{part}": f"{path}.{part}" for part in EMBEDDING_PARTS}}

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        modules = self._embedding_modules() if stage == 0 else {}
        if stage == layout.num_stages - 1:
            modules.update(self.head_modules)
        return modules

    def optional_modules(self, model, layout) -> set[str]:
        """The embedding parts and the outermost head modules (a module inside a dropped one goes with it)."""
        parts = set(self._embedding_modules().values()) - {f"{self.base}.embeddings"}
        paths = parts | set(self.head_modules.values())
        return {path for path in paths if not any(path.startswith(outer + ".") for outer in paths)}

    # ------------------------------------------------------------------ batches and shapes
    def use_sequence_parallel(self, model, batch) -> bool:
        return use_sequence_parallel(model, batch["input_ids"].shape[-1])

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        mb, seq_len = microbatch["input_ids"].shape
        return self.hidden_state_io(model, layout, stage, microbatch, sequence_parallel,
                                    lambda: self.head_output_shape(model, mb, seq_len))

    # ------------------------------------------------------------------ compute
    def stage_forward(self, stage, x, attention_mask=None, token_type_ids=None, position_ids=None):
        context, sp = stage.parallel_context, stage.sequence_parallel
        if stage.is_first:  # token_type_ids / position_ids reach every stage; only the embeddings read them
            hidden = stage.embeddings(input_ids=x, token_type_ids=token_type_ids, position_ids=position_ids)
            if sp:
                hidden = enter_sequence_parallel(hidden, context)
        else:
            hidden = x
        # The mask reads only the batch size, sequence length, dtype and device of inputs_embeds: a zero-size
        # expanded view stands in for the full [mb, s, h] activations that only the first stage ever has.
        seq_len = hidden.shape[1] * (context.tp_size if sp else 1)
        shape_only = hidden.new_zeros(()).expand(hidden.shape[0], seq_len, hidden.shape[-1])
        mask = create_bidirectional_mask(config=stage.model_config, inputs_embeds=shape_only,
                                         attention_mask=attention_mask)
        for layer in stage.layers:
            hidden = layer(hidden, mask, sequence_parallel=sp)
        if not stage.is_last:
            return hidden
        if sp:
            hidden = leave_sequence_parallel(hidden, context)
        return self.head_forward(stage, hidden)

    # ------------------------------------------------------------------ the head (subclasses)
    def head_forward(self, stage, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's output from the full-sequence hidden states ``[mb, s, h]``."""
        raise NotImplementedError

    def head_output_shape(self, model, mb: int, seq_len: int) -> tuple[int, ...]:
        """The shape of ``head_forward``'s output for a microbatch of ``mb`` sequences of ``seq_len`` tokens."""
        raise NotImplementedError

    def head_parameter_count(self, config) -> int:
        raise NotImplementedError


class BertMLMPipelineAdapter(BertPipelineAdapter):
    """Masked LM: the last stage runs ``cls.predictions`` (transform, then the vocab-parallel decoder tied to the
    word embeddings) -> local logits ``[mb, s, V_padded/tp]``; the loss runs on the split vocabulary (no shift,
    ``-100`` ignored), as ``BertForMaskedLM.forward``'s."""

    head = "cls.predictions"  # the module whose forward maps hidden states to local logits
    # ``cls`` is the module dropped off the last stage; the decoder is named for the tied group's owners.
    head_modules = {"cls": "cls", "lm_head": head, "decoder": f"{head}.decoder"}

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        if getattr(model.config, "tie_word_embeddings", False):
            return [(f"{self.base}.embeddings.word_embeddings.weight", f"{self.head}.decoder.weight")]
        return []

    def head_forward(self, stage, hidden):
        return stage.lm_head(hidden)  # [mb, s, V_padded/tp]

    def head_output_shape(self, model, mb, seq_len):
        return mb, seq_len, model.get_submodule(self.head).decoder.weight.shape[0]

    def head_parameter_count(self, config) -> int:
        h, vocab = config.hidden_size, config.vocab_size
        return (h * h + h) + 2 * h + (vocab * h + vocab)  # transform dense + LayerNorm, decoder (+ its bias)

    def loss(self, model, local_logits, labels, num_items_in_batch):
        return token_loss(local_logits, labels, model.get_submodule(self.head).decoder,
                          num_items_in_batch=num_items_in_batch)


class BertSequenceClassificationPipelineAdapter(BertPipelineAdapter):
    """Sequence classification: the last stage runs the pooler on ``[CLS]``, dropout and the replicated
    ``classifier`` -> ``logits [mb, num_labels]``; the loss is the model's (``config.problem_type``), turned from
    the microbatch mean into its share of the whole batch's mean."""

    head_modules = {"pooler": "bert.pooler", "dropout": "dropout", "classifier": "classifier"}

    def head_forward(self, stage, hidden):
        return stage.classifier(stage.dropout(stage.pooler(hidden)))

    def head_output_shape(self, model, mb, seq_len):
        return mb, model.config.num_labels

    def head_parameter_count(self, config) -> int:
        h = config.hidden_size
        return (h * h + h) + (h * config.num_labels + config.num_labels)

    def num_loss_items(self, labels: torch.Tensor) -> int:
        """What the model's mean runs over: labels other than ``-100`` (class indices) or every value (regression,
        multi-label targets)."""
        return int((labels != -100).sum()) if not labels.is_floating_point() else labels.numel()

    def loss(self, model, logits, labels, num_items_in_batch):
        items = self.num_loss_items(labels)
        if not items:  # every label of this microbatch ignored: it adds nothing (the mean would be NaN)
            return logits.sum() * 0.0
        return sequence_classification_loss(logits, labels, model.config) * (items / num_items_in_batch)
