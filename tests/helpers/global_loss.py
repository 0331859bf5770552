"""What a data-parallel step must compute: the loss of the *global* batch (``oslo_models/training/global_batch.py``).

The reference is single-process ``transformers`` on every replica's rows. Its token loss over the global batch is
``sum over replicas of (replica token-loss sum) / N`` with ``N`` the label tokens of all replicas; a replica's own
``loss`` is its mean ``sum_r / n_r``. So the loss a data-parallel rank returns (``sum_r * dp / N``, the value whose
dp-mean is the global loss) is ``w_r * ce_r`` with ``w_r = n_r * dp / N``, plus any per-replica term the model adds
(the MoE load-balancing or router z-loss: ``loss_r - ce_r``, averaged over replicas as DDP averages it). ``ce_r`` is
recomputed here from the reference's logits with ``torch.nn.functional.cross_entropy`` (independent of the library).

The parallel model gets its ``num_items_in_batch`` from the library's own loader (:func:`with_global_share`), the
path ``training.prepare`` gives every user.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _targets(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=-100)[..., 1:] if shift else labels


def label_count(replica: dict, shift: bool) -> int:
    """Label tokens of a replica's (whole-sequence) rows; 0 for a sequence-level loss."""
    labels = replica.get("labels")
    if labels is None or labels.dim() < 2:
        return 0
    return int((_targets(labels, shift) != -100).sum())


def token_mean(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """``transformers``' token cross-entropy mean (``ignore_index=-100``; ``shift``: causal)."""
    targets = _targets(labels, shift).to(logits.device)
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total / (targets != -100).sum().clamp(min=1)


def replica_weights(replicas: list[dict], shift: bool, model=None) -> list[float]:
    """``w_r = n_r * dp / N`` (1 for every replica of a sequence-level loss, or of a ``model`` whose loss is not a
    token cross-entropy: it keeps its per-replica mean)."""
    from oslo_models.training.global_batch import loss_is_per_token

    if model is not None and not loss_is_per_token(model):
        return [None] * len(replicas)
    counts = [label_count(replica, shift) for replica in replicas]
    total = sum(counts)
    if total == 0:
        return [1.0 if not counts[i] else 0.0 for i in range(len(replicas))]
    return [count * len(replicas) / total for count in counts]


def replica_loss(output, replica: dict, weight: float, shift: bool, logits_name: str = "logits") -> torch.Tensor:
    """What a rank of this replica returns: ``weight * ce + (loss - ce)`` (see the module docstring)."""
    labels = replica.get("labels")
    if labels is None or labels.dim() < 2 or weight is None:
        return output.loss
    ce = token_mean(output[logits_name], labels, shift)
    return weight * ce + (output.loss - ce)


def with_global_share(model, local: dict, shift: bool, accumulation_steps: int = 1) -> dict:
    """``local`` with the ``num_items_in_batch`` the loader of ``training.prepare`` attaches for ``model`` (one
    all-reduce; nothing for a loss that is not a token cross-entropy, e.g. ELECTRA's discriminator)."""
    from oslo_models.training.global_batch import GlobalBatchLoader, loss_is_per_token

    loader = GlobalBatchLoader([local], context=model.parallel_context, shifts_labels=shift,
                               accumulation_steps=accumulation_steps, token_loss=loss_is_per_token(model))
    (batch,) = list(loader)
    return batch


def part_reference_steps(reference, rows: list[dict], parts: int, size: int, collate, steps: int = 3):
    """Single-process ``transformers`` trained ``steps`` AdamW steps, step ``k`` on the ``parts`` consecutive groups of
    ``size`` rows from row ``k * parts * size`` (the replicas, or every replica's microbatches): the global batch's
    token loss plus each part's own per-part term (the MoE router loss), each part's token loss weighted by its share
    of the global label count (``replica_loss``). Returns the trained reference and each step's loss."""
    from tests.helpers.pipeline import ADAMW

    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    losses = []
    for step in range(steps):
        chunks = [collate(rows[(step * parts + j) * size:(step * parts + j + 1) * size]) for j in range(parts)]
        weights = replica_weights(chunks, shift=True)
        loss = sum(replica_loss(reference(**chunk), chunk, weight, shift=True)
                   for chunk, weight in zip(chunks, weights)) / parts
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
        losses.append(loss.item())
    return reference, losses
