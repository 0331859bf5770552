"""GRPO and RLOO policy losses on vocab-split log-probabilities of sampled completions.

A rollout batch (:func:`~oslo_models.post_training.rollout.generate_completions`): ``prompt_ids [B, P]`` (left
padded) and ``prompt_mask``, ``completion_ids [B, C]`` and ``completion_mask`` (1 up to and including the first
EOS), ``advantages [B]`` (:mod:`~oslo_models.post_training.advantages`), optionally ``old_per_token_logps [B, C]``
(the sampling policy's, when a rollout is reused for several steps) and ``ref_per_token_logps [B, C]``.

Per completion token, with ``ratio = exp(log pi - log pi_old)`` (token level, or the masked mean of the log-ratio per
sequence with ``importance_sampling_level="sequence"``) and TRL's ``GRPOTrainer`` formulas:

    loss_t = -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) + beta (exp(ref - logp) - (ref - logp) - 1)

aggregated as TRL's ``loss_type`` says:

- ``"grpo"``: each sequence's token mean, then the mean over sequences (sequence level);
- ``"bnpo"``: the mean over the replica's completion tokens;
- ``"dr_grpo"``: the sum over tokens / (``B x max_completion_length``);
- ``"dapo"``: the sum over tokens / ``num_items_in_batch`` (token level over the global batch: this rank's share of
  the global completion-token count, ``global / dp`` as in ``training/global_batch.py``; default the replica's own
  count, i.e. ``"bnpo"``).

``rloo_loss`` is TRL's ``RLOOTrainer``'s: the ratio of whole-sequence log-probabilities, clipped, mean over
sequences. Under DDP / ZeRO each replica's loss is averaged over dp: with the same number of completions per replica
``"grpo"`` is the global batch's sequence mean, and ``"dapo"`` with the global share is the global token mean.
"""
from __future__ import annotations

import torch

from .frozen import run_frozen
from .log_probs import sequence_token_log_probs

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LEVELS = ("token", "sequence")


def per_token_kl(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """GRPO's per-token KL estimate to the reference (Schulman's k3): ``exp(r - p) - (r - p) - 1 >= 0``."""
    delta = ref_per_token_logps - per_token_logps
    return torch.exp(delta) - delta - 1


def grpo_loss(per_token_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              old_per_token_logps: torch.Tensor | None = None, ref_per_token_logps: torch.Tensor | None = None,
              beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float | None = None,
              loss_type: str = "grpo", importance_sampling_level: str = "token",
              max_completion_length: int | None = None, num_items_in_batch=None) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` from ``per_token_logps [B, C]`` (differentiable), ``advantages [B]`` and the completion
    ``mask [B, C]`` (see the module docstring). ``old_per_token_logps=None``: the policy sampled these (ratio 1,
    the gradient of ``ratio`` is that of ``log pi``). No collective."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {LEVELS}, got {importance_sampling_level!r}")
    if beta and ref_per_token_logps is None:
        raise ValueError("beta > 0 adds a KL to the reference: pass ref_per_token_logps (or a reference model)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by max_completion_length: pass it")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(per_token_logps.dtype)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.to(per_token_logps.dtype).unsqueeze(-1)
    loss_t = -torch.min(ratio * adv, clipped * adv)
    metrics = {}
    if beta:
        kl = per_token_kl(per_token_logps, ref_per_token_logps)
        loss_t = loss_t + beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1.0)).detach()
    if loss_type == "grpo":
        loss = ((loss_t * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (loss_t * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (loss_t * mask).sum() / (loss_t.shape[0] * max_completion_length)
    else:
        count = mask.sum().clamp(min=1.0) if num_items_in_batch is None else torch.as_tensor(
            num_items_in_batch, device=mask.device, dtype=mask.dtype).clamp(min=1.0)
        loss = (loss_t * mask).sum() / count
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
    metrics["clip_ratio/low"] = ((low * mask).sum() / mask.sum().clamp(min=1.0)).detach()
    metrics["clip_ratio/high"] = ((high * mask).sum() / mask.sum().clamp(min=1.0)).detach()
    return loss, metrics


def rloo_loss(per_token_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              old_per_token_logps: torch.Tensor | None = None, epsilon_low: float = 0.2,
              epsilon_high: float | None = None) -> torch.Tensor:
    """TRL ``RLOOTrainer``'s loss: ``ratio = exp(sum_t logp - sum_t logp_old)`` per sequence, ``-min(ratio A,
    clip(ratio) A)``, mean over sequences. No collective."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(per_token_logps.dtype)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    ratio = torch.exp((per_token_logps * mask).sum(1) - (old * mask).sum(1))
    adv = advantages.to(per_token_logps.dtype)
    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv).mean()


def _model_inputs(batch: dict) -> dict:
    prompt_mask, completion_mask = batch["prompt_mask"], batch["completion_mask"]
    return {"input_ids": torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
            "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
            "completion_mask": torch.cat([torch.zeros_like(prompt_mask), completion_mask], dim=1)}


def completion_log_probs(model, batch: dict, *, temperature: float = 1.0, outputs=("log_probs",)) -> dict:
    """Fields ``[B, C]`` of ``model`` on a rollout batch's completion tokens (0 after the first EOS)."""
    inputs = _model_inputs(batch)
    fields = sequence_token_log_probs(model, inputs["input_ids"], inputs["attention_mask"],
                                      inputs["completion_mask"], temperature=temperature, outputs=outputs)
    width = batch["completion_ids"].shape[1]
    return {name: value[:, -width:] for name, value in fields.items()}


def reference_completion_log_probs(reference, batch: dict, *, temperature: float = 1.0) -> torch.Tensor:
    """``[B, C]`` the frozen ``reference``'s completion log-probabilities at its own layout (no grad)."""
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    return run_frozen(reference, {key: batch[key] for key in keys},
                      lambda model, b: completion_log_probs(model, b, temperature=temperature))["log_probs"]


def grpo_objective(model, batch: dict, *, reference=None, beta: float = 0.0, temperature: float = 1.0,
                   **loss_options) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` of the policy ``model`` on a rollout batch: its completion log-probabilities (vocab
    parallel), the reference's (a frozen model at its own layout, or ``batch["ref_per_token_logps"]``) when ``beta
    > 0``, then :func:`grpo_loss` (``loss_options``: its keywords). ``temperature``: the sampling temperature the
    log-probabilities are taken at (TRL's). Collectives: the models' forwards and ``losses``' all-reduces."""
    ref = batch.get("ref_per_token_logps")
    if beta and ref is None:
        if reference is None:
            raise ValueError("beta > 0 needs a frozen reference model or batch['ref_per_token_logps']")
        ref = reference_completion_log_probs(reference, batch, temperature=temperature)
    fields = completion_log_probs(model, batch, temperature=temperature, outputs=("log_probs", "entropy"))
    loss, metrics = grpo_loss(fields["log_probs"], batch["advantages"], batch["completion_mask"],
                              old_per_token_logps=batch.get("old_per_token_logps"), ref_per_token_logps=ref,
                              beta=beta, **loss_options)
    mask = batch["completion_mask"].to(fields["entropy"].dtype)
    metrics["entropy"] = ((fields["entropy"] * mask).sum() / mask.sum().clamp(min=1.0)).detach()
    return loss, metrics
