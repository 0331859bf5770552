"""Post-training at any tensor x data-parallel layout: DPO, GRPO / RLOO and knowledge distillation.

Every objective scores sequences with the vocabulary-parallel primitives of :mod:`oslo_models.losses` on the
model's vocab-split logits (``gather_logits=False``): no rank ever holds ``[tokens, vocab]`` logits whole. A frozen
reference or teacher may sit at its own layout (:func:`run_frozen`); completions are sampled by the model's own
``generate`` at its layout (:func:`generate_completions`, the same tokens on every tp rank).

    loss, metrics = om.post_training.dpo_objective(model, batch, reference=ref_model, beta=0.1)
    rollout = om.post_training.generate_completions(model, prompt_ids, prompt_mask, num_generations=4, ...)
    rollout["advantages"] = om.post_training.group_advantages(rewards, 4)
    loss, metrics = om.post_training.grpo_objective(model, rollout, reference=ref_model, beta=0.04)
    loss, metrics = om.post_training.distill_objective(student, batch, teacher=teacher, top_k=64, alpha=0.5)
    loss, metrics = om.post_training.train_step(model, optimizer, om.post_training.dpo_objective, batch, ...)

A pipelined model trains the three objectives through ``train_step`` (each runs as the last stage's loss of every
microbatch, frozen models precomputed before the step: :mod:`.pipelined`); its forward returns no logits, so the
objectives themselves refuse it (``PIPELINE_REFUSAL``). TRL's trainers run through
``om.training.ParallelTrainerMixin``.
"""
from .advantages import group_advantages, rloo_advantages
from .distill import distill_objective, distillation_loss, teacher_topk
from .dpo import dpo_loss, dpo_objective, pair_share, reference_log_probs, sequence_log_probs
from .frozen import run_frozen
from .grpo import (
    completion_log_probs,
    grpo_loss,
    grpo_objective,
    per_token_kl,
    reference_completion_log_probs,
    rloo_loss,
)
from .log_probs import PIPELINE_REFUSAL, local_logits, sequence_token_log_probs
from .pipelined import pipeline_train_step
from .rollout import generate_completions
from .step import train_step

__all__ = [
    "PIPELINE_REFUSAL", "completion_log_probs", "distill_objective", "distillation_loss", "dpo_loss", "dpo_objective",
    "generate_completions", "group_advantages", "grpo_loss", "grpo_objective", "local_logits", "pair_share",
    "per_token_kl", "pipeline_train_step", "reference_completion_log_probs", "reference_log_probs",
    "rloo_advantages", "rloo_loss", "run_frozen", "sequence_log_probs", "sequence_token_log_probs", "teacher_topk",
    "train_step",
]
