"""Direct Preference Optimization on vocab-split log-probabilities: the sigmoid, IPO and length-normalized losses.

A preference batch packs each pair as two rows, TRL's convention: ``input_ids [2n, s]`` holds the ``n`` chosen
sequences (prompt + chosen completion) then the ``n`` rejected ones, with ``attention_mask`` and ``completion_mask``
(1 on the completion's tokens) of the same shape. A sequence's log-probability is the sum of its completion tokens'
log-probabilities (:func:`~oslo_models.post_training.log_probs.sequence_token_log_probs`, exact at any
tensor-parallel size). With ``d = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))``, per pair (TRL's
``DPOTrainer`` formulas, ``f_divergence_type="reverse_kl"``):

- ``"sigmoid"`` (DPO): ``-log sigmoid(beta * d)``;
- ``"ipo"``: ``((lc_c / |c| - lc_r / |r|) - 1 / (2 beta))^2`` with ``lc = log pi - log ref`` and ``|c|`` the
  completion's token count (TRL's length-normalized IPO);
- ``"sigmoid_norm"`` (length-normalized DPO): ``-log sigmoid(beta * (lc_c / |c| - lc_r / |r|))``.

The loss is the mean over the pairs of the global batch. DPO is a sequence-level loss: with the same number of
pairs on every data-parallel replica (and accumulation micro-step), each replica's mean averaged by DDP / ZeRO is
that mean. ``num_pairs_in_batch`` (this rank's share of the global pair count, ``global / (dp x accumulation)``,
see :func:`pair_share`) makes it exact for unequal replicas too: ``sum of the replica's pair losses / share``.

The reference is a frozen model at its own layout (:func:`~oslo_models.post_training.frozen.run_frozen`) or
precomputed sequence log-probabilities (``batch["ref_chosen_logps"]``, ``batch["ref_rejected_logps"]``, ``[n]``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .frozen import run_frozen
from .log_probs import sequence_token_log_probs

LOSS_TYPES = ("sigmoid", "ipo", "sigmoid_norm")
MODEL_KEYS = ("input_ids", "attention_mask", "completion_mask")


def pair_share(num_local_pairs: int, context, accumulation_steps: int = 1) -> torch.Tensor:
    """This rank's share of the global batch's pair count, ``max(N, 1) / (dp x accumulation_steps)``, ``N`` summed
    over the data-parallel group (one all-reduce; every data rank calls it; tp ranks hold the same pairs)."""
    from ..training.global_batch import global_share

    return global_share(torch.tensor(num_local_pairs), context, accumulation_steps)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, loss_type: str = "sigmoid",
             chosen_lengths: torch.Tensor | None = None, rejected_lengths: torch.Tensor | None = None,
             num_pairs_in_batch=None) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` from sequence log-probabilities ``[n]`` of the policy and the reference (see the module
    docstring). ``chosen_lengths`` / ``rejected_lengths`` (``[n]`` completion token counts) are needed by
    ``"ipo"`` and ``"sigmoid_norm"``. ``metrics``: ``rewards/chosen``, ``rewards/rejected`` (``beta x`` log-ratio,
    detached, ``[n]``) and the per-pair losses. No collective."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        per_pair = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    else:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"loss_type={loss_type!r} normalizes by completion length: pass chosen_lengths and "
                             "rejected_lengths")
        delta = (chosen_ratio / chosen_lengths.clamp(min=1.0).to(chosen_ratio)
                 - rejected_ratio / rejected_lengths.clamp(min=1.0).to(rejected_ratio))
        per_pair = (delta - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * delta)
    if num_pairs_in_batch is None:
        loss = per_pair.mean()
    else:
        loss = per_pair.sum() / torch.as_tensor(num_pairs_in_batch, device=per_pair.device, dtype=per_pair.dtype)
    metrics = {"rewards/chosen": beta * chosen_ratio.detach(), "rewards/rejected": beta * rejected_ratio.detach(),
               "per_pair_loss": per_pair.detach()}
    return loss, metrics


def sequence_log_probs(model, batch: dict) -> torch.Tensor:
    """``[2n]`` summed completion log-probabilities of a preference batch's rows (differentiable)."""
    fields = sequence_token_log_probs(model, batch["input_ids"], batch.get("attention_mask"),
                                      batch["completion_mask"])
    return fields["log_probs"].sum(-1)


def reference_log_probs(reference, batch: dict) -> torch.Tensor:
    """``[2n]`` the frozen ``reference``'s summed completion log-probabilities, at its own layout (no grad)."""
    inputs = {key: batch[key] for key in MODEL_KEYS if batch.get(key) is not None}
    out = run_frozen(reference, inputs, lambda model, b: {"logps": sequence_log_probs(model, b)})
    return out["logps"]


def dpo_objective(model, batch: dict, *, reference=None, beta: float = 0.1, loss_type: str = "sigmoid",
                  num_pairs_in_batch=None) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` of the policy ``model`` (any wrapper) on a preference batch (module docstring), against a
    frozen ``reference`` model or the batch's precomputed ``ref_chosen_logps`` / ``ref_rejected_logps``.

    Collectives: the policy's forward and vocab-parallel log-softmax (``losses``), the reference's (and
    ``run_frozen``'s gathers when its tp group holds other batches); backward: the policy's own."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    missing = [key for key in ("input_ids", "completion_mask") if key not in batch]
    if missing:
        raise ValueError(f"a preference batch needs {missing}")
    if batch["input_ids"].shape[0] % 2:
        raise ValueError(f"a preference batch holds chosen then rejected rows: an even row count, got "
                         f"{batch['input_ids'].shape[0]}")
    precomputed = "ref_chosen_logps" in batch and "ref_rejected_logps" in batch
    if reference is None and not precomputed:
        raise ValueError("pass a frozen reference model or precomputed ref_chosen_logps / ref_rejected_logps")
    logps = sequence_log_probs(model, batch)
    if precomputed:
        ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    else:
        ref_chosen, ref_rejected = reference_log_probs(reference, batch).chunk(2)
    lengths = batch["completion_mask"].sum(-1).float()  # TRL counts the unshifted mask
    chosen_lengths, rejected_lengths = lengths.chunk(2)
    chosen, rejected = logps.chunk(2)
    loss, metrics = dpo_loss(chosen, rejected, ref_chosen.to(chosen), ref_rejected.to(chosen), beta=beta,
                             loss_type=loss_type, chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths,
                             num_pairs_in_batch=num_pairs_in_batch)
    metrics.update({"logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()})
    return loss, metrics
