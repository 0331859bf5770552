"""Loss rules shared by the classification heads of every family (the same rules as ``transformers``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
