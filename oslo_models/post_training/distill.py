"""Knowledge distillation: a forward or reverse KL to a teacher mixed with the language-model loss.

Per target token (``labels`` shifted left as a causal LM's, ``-100`` ignored), with ``T`` the temperature:

    loss = alpha * KL + (1 - alpha) * CE

both the mean over the batch's target tokens (or ``sum / num_items_in_batch``: this rank's share of the global
batch's target count, ``training/global_batch.py``, so that the loss is the global batch's token mean under DDP /
ZeRO and gradient accumulation). ``KL`` is :func:`~oslo_models.losses.kl_divergence` (``direction="forward"``:
KL(teacher || student); ``"reverse"``: KL(student || teacher)) when the teacher's logits are split like the student's
(the same tensor-parallel group and padded vocabulary), else :func:`~oslo_models.losses.topk_kl_divergence` against
the teacher's top-``k`` logits and ids: a teacher of another size or layout (its top-k computed at its own layout by
:func:`~oslo_models.losses.topk_logits`, each rank taking its rows back through ``run_frozen``), or top-k logits
precomputed offline (``batch["teacher_values"]``, ``batch["teacher_indices"]``, ``[b, s, k]`` aligned with the
logits: position ``i`` is the distribution of token ``i + 1``). ``CE`` is the vocab-parallel cross-entropy
(``-log p`` of the label). TRL's ``DistillationTrainer`` defines the divergences the same way (no ``T^2`` factor).

Collectives: the two models' forwards, ``losses``' all-reduces (a few ``[k, tokens]`` vectors) and, for a teacher
whose tensor-parallel group holds other batches, ``run_frozen``'s all-gathers of the batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..losses import VocabShard, kl_divergence, token_log_probs, topk_kl_divergence, topk_logits
from .frozen import run_frozen
from .log_probs import base_model_of, local_logits, next_token_targets


def _same_split(student, teacher) -> bool:
    """Whether the two models' output layers split the vocabulary alike (the same ranks, first id, local width and
    vocabulary): read from the layers, before any forward."""
    heads = [base_model_of(model).get_output_embeddings() for model in (student, teacher)]
    shards = [VocabShard.of(head) for head in heads]
    widths = [head.weight.shape[0] for head in heads]
    if (shards[0].size, shards[0].vocab_start, shards[0].vocab_size, widths[0]) != (
            shards[1].size, shards[1].vocab_start, shards[1].vocab_size, widths[1]):
        return False
    if shards[0].size == 1:
        return True
    return dist.get_process_group_ranks(shards[0].group) == dist.get_process_group_ranks(shards[1].group)


def distillation_loss(student_logits: torch.Tensor, targets: torch.Tensor, *, shard: VocabShard | None = None,
                      teacher_logits: torch.Tensor | None = None, teacher_values: torch.Tensor | None = None,
                      teacher_indices: torch.Tensor | None = None, alpha: float = 0.5, direction: str = "forward",
                      temperature: float = 1.0, num_items_in_batch=None) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` from the student's vocab-split logits ``[b, s, V_local]`` scoring ``targets [b, s]``
    (aligned: position ``i`` is scored against ``targets[:, i]``; ``-100`` ignored) and the teacher as split logits
    ``teacher_logits`` (the student's split) or top-k ``teacher_values`` / ``teacher_indices`` ``[b, s, k]``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if (teacher_logits is None) == (teacher_values is None):
        raise ValueError("pass the teacher as teacher_logits or as teacher_values + teacher_indices (one of the two)")
    mask = (targets != -100).to(torch.float32)
    count = mask.sum().clamp(min=1.0) if num_items_in_batch is None else torch.as_tensor(
        num_items_in_batch, device=mask.device, dtype=torch.float32)
    if teacher_logits is not None:
        kl = kl_divergence(student_logits, teacher_logits, direction=direction, shard=shard, temperature=temperature)
    else:
        kl = topk_kl_divergence(student_logits, teacher_values, teacher_indices, direction=direction, shard=shard,
                                temperature=temperature)
    kd = (kl * mask).sum() / count
    ce = -token_log_probs(student_logits, targets, shard=shard).sum() / count
    return alpha * kd + (1 - alpha) * ce, {"kd": kd.detach(), "ce": ce.detach()}


def teacher_topk(teacher, batch: dict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` ``[b, s, k]``: the frozen ``teacher``'s top-``k`` next-token logits on this rank's
    ``batch`` (``input_ids``, ``attention_mask``), computed at the teacher's own layout (no grad)."""
    def fn(model, b):
        logits, shard = local_logits(model, b["input_ids"], b.get("attention_mask"))
        values, indices = topk_logits(logits, k, shard=shard)
        return {"values": values, "indices": indices}

    out = run_frozen(teacher, {key: batch[key] for key in ("input_ids", "attention_mask") if key in batch}, fn)
    return out["values"], out["indices"]


def distill_objective(student, batch: dict, *, teacher=None, top_k: int | None = None, alpha: float = 0.5,
                      direction: str = "forward", temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` of ``student`` on ``batch`` (``input_ids``, ``attention_mask``, ``labels`` (``-100``
    ignored), optionally ``num_items_in_batch``) against ``teacher`` (a frozen model: its split logits when they are
    split like the student's and ``top_k`` is ``None``, else its top-``top_k``) or the batch's precomputed
    ``teacher_values`` / ``teacher_indices``."""
    precomputed = "teacher_values" in batch and "teacher_indices" in batch
    if teacher is None and not precomputed:
        raise ValueError("pass a frozen teacher model or precomputed batch['teacher_values'] / ['teacher_indices']")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be positive, got {top_k}")
    if not precomputed and top_k is None and not _same_split(student, teacher):
        raise ValueError("the teacher's logits are not split like the student's (another tensor-parallel group or "
                         "vocabulary): pass top_k to distill from its top-k logits at its own layout")
    logits, shard = local_logits(student, batch["input_ids"], batch.get("attention_mask"))
    labels = batch.get("labels", batch["input_ids"])
    targets = next_token_targets(labels.to(logits.device), None)
    teacher_args = {}
    if precomputed:
        teacher_args = dict(teacher_values=batch["teacher_values"], teacher_indices=batch["teacher_indices"])
    elif top_k is None:
        with torch.no_grad():
            teacher_logits, _ = local_logits(teacher, batch["input_ids"], batch.get("attention_mask"))
        teacher_args = dict(teacher_logits=teacher_logits)
    else:
        values, indices = teacher_topk(teacher, batch, top_k)
        teacher_args = dict(teacher_values=values, teacher_indices=indices)
    return distillation_loss(logits, targets, shard=shard, alpha=alpha, direction=direction, temperature=temperature,
                             num_items_in_batch=batch.get("num_items_in_batch"), **teacher_args)
