"""One optimizer step of a post-training objective on a prepared model: loss, backward, clip, step.

    model, optimizer = om.training.prepare(accelerator, model, optimizer, zero_stage=3)[:2]
    loss, metrics = om.post_training.train_step(model, optimizer, om.post_training.dpo_objective, batch,
                                                accelerator=accelerator, max_grad_norm=1.0, reference=ref, beta=0.1)

``objective(model, batch, **options) -> (loss, metrics)`` is any of :func:`dpo_objective`, :func:`grpo_objective`,
:func:`distill_objective` (or your own). The model is what ``om.training.prepare`` / ``shard_data_parallel``
returned (DDP or ZeRO 1-3 over the data-parallel group, any 1D tensor-parallel size, sequence parallelism); the
backward is ``accelerator.backward`` (mixed precision, accumulation) or ``loss.backward``; the gradient norm is the
whole model's (``training.clip_grad_norm_``: tp-split pieces summed over tp). A pipelined model (not wrapped; no
``accelerator``) runs the three objectives as its last stage's loss (:mod:`.pipelined`); other objectives are
refused there.

The returned loss is the mean over the data-parallel group of the replicas' losses (one all-reduce of a scalar):
every objective returns the replica's share of the global batch's loss, so that mean is the global batch's loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import training
from .log_probs import base_model_of


def train_step(model, optimizer, objective, batch: dict, *, accelerator=None, max_grad_norm: float | None = None,
               **options) -> tuple[torch.Tensor, dict]:
    """``(global loss, metrics)`` after ``objective``'s backward and one ``optimizer.step()`` (gradients zeroed
    after). Collectives: the objective's, the clipping's and one all-reduce of the loss over dp."""
    context = getattr(base_model_of(model), "parallel_context", None)
    if context is not None and context.pp_size > 1:
        if accelerator is not None:
            raise ValueError("a pipelined model steps through its own schedule: train_step takes no accelerator")
        from .pipelined import pipeline_train_step

        return pipeline_train_step(model, optimizer, objective, batch, max_grad_norm=max_grad_norm, **options)
    loss, metrics = objective(model, batch, **options)
    if accelerator is not None:
        accelerator.backward(loss)
    else:
        loss.backward()
    if max_grad_norm:
        metrics["grad_norm"] = training.clip_grad_norm_(model, max_grad_norm, accelerator=accelerator)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().float().clone()
    if context is not None and context.dp_size > 1:
        dist.all_reduce(mean, group=context.dp_group)
        mean /= context.dp_size
    return mean, metrics
