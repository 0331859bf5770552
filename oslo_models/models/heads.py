"""Outputs and loss rules shared by the classification heads of every family (the same rules as
``transformers``). The heads themselves are replicated (never split): their inputs are full ``[b, s, h]``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import (
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    TokenClassifierOutput,
)

from .common.outputs import passed_on


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


def token_classification_output(logits, labels, base_outputs=None) -> TokenClassifierOutput:
    """``logits [b, s, num_labels]``; cross-entropy over every token (``-100`` ignored)."""
    loss = None
    if labels is not None:
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.to(logits.device).view(-1))
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
