"""Group-relative advantages of sampled completions: GRPO's normalized and RLOO's leave-one-out baselines.

``rewards [B]`` holds ``B / G`` groups of ``G = num_generations`` consecutive completions of the same prompt (what
:func:`~oslo_models.post_training.rollout.generate_completions` returns, and TRL's ``RepeatSampler`` order). The
formulas are TRL's (``GRPOTrainer._generate_and_score_completions``, ``RLOOTrainer``), with the unbiased (Bessel)
standard deviation and ``1e-4`` added to it:

- GRPO ``scale_rewards="group"``: ``(r - mean_group) / (std_group + 1e-4)``; ``"batch"``: the batch's std;
  ``"none"``: ``r - mean_group`` (Dr. GRPO);
- RLOO: ``r - mean of the group's other G - 1 rewards``; ``normalize=True`` then standardizes over the batch.

Each data-parallel replica must hold whole groups (its rollouts are its own prompts x ``G``): the statistics are
then the replica's own, and no collective runs. Tensor-parallel ranks hold the same rewards.
"""
from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")
EPS = 1e-4


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [completions], got {tuple(rewards.shape)}")
    if num_generations < 2 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of num_generations={num_generations} "
                         "(at least 2 per group, whole groups on every replica)")
    return rewards.float().view(-1, num_generations)


def group_advantages(rewards: torch.Tensor, num_generations: int, *, scale_rewards: str = "group") -> torch.Tensor:
    """``[B]`` GRPO advantages of ``rewards [B]`` (groups of ``num_generations`` consecutive rows)."""
    if scale_rewards not in SCALES:
        raise ValueError(f"scale_rewards must be one of {SCALES}, got {scale_rewards!r}")
    grouped = _grouped(rewards, num_generations)
    advantages = (grouped - grouped.mean(1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1).repeat_interleave(num_generations) + EPS)
    elif scale_rewards == "batch":
        advantages = advantages / (grouped.reshape(-1).std() + EPS)
    return advantages


def rloo_advantages(rewards: torch.Tensor, num_generations: int, *, normalize: bool = False) -> torch.Tensor:
    """``[B]`` RLOO advantages: each reward minus the mean of its group's other rewards; ``normalize``:
    standardized over the batch (``(a - mean) / (std + 1e-4)``)."""
    grouped = _grouped(rewards, num_generations)
    baselines = (grouped.sum(1, keepdim=True) - grouped) / (num_generations - 1)
    advantages = (grouped - baselines).view(-1)
    if normalize:
        advantages = (advantages - advantages.mean()) / (advantages.std() + EPS)
    return advantages
