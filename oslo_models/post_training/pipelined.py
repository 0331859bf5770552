"""DPO, GRPO and distillation on a pipelined model: the objective runs as the last stage's loss of each microbatch.

A pipelined model's forward is its schedule (``model.train_step``): the logits exist only on the last stage, one
microbatch at a time. :func:`pipeline_train_step` (what :func:`~oslo_models.post_training.train_step` runs for a
model with ``pipeline_parallel_size > 1``) therefore:

1. computes everything that needs another model before the step, at that model's own (unpipelined) layout through
   ``run_frozen``: the reference's sequence / completion log-probabilities (DPO, GRPO with ``beta > 0``), the
   teacher's top-``k`` logits (distillation: ``top_k`` or the batch's precomputed ``teacher_values`` /
   ``teacher_indices``; a full-vocabulary teacher is refused, its logits would have to cross the pipeline);
2. builds per-row tensors (next-token targets, reference log-probabilities, advantages, teacher top-k) and the
   replica's share of the global divisor (pairs, sequences or target tokens, one all-reduce over dp as in
   ``training/global_batch.py``), and orders a preference batch's rows so that each microbatch holds whole pairs
   (microbatch ``m``: the chosen rows of pairs ``m n / M .. (m + 1) n / M - 1`` then their rejected rows);
3. runs ``model.train_step(inputs, loss_fn=..., loss_inputs=rows)``: the runner splits the rows with the inputs and
   calls the loss on the last stage's vocab-split logits of each microbatch, which returns the microbatch's share:
   its summed pair / sequence / token terms over the replica's share of the global count (``"grpo"`` and
   ``"dr_grpo"``: its rows' fraction of the replica's). Summed over the microbatches and averaged over dp by the
   runner, that is the global batch's loss, and the gradients are those of the unpipelined objective.

Collectives: the frozen model's (``run_frozen``), the share's all-reduce, the schedule's and the vocabulary-parallel
log-softmax's on the last stage.
"""
from __future__ import annotations

import torch

from .. import training
from ..losses import VocabShard, token_log_probs
from ..training.global_batch import global_share
from .distill import distill_objective, distillation_loss, teacher_topk
from .dpo import LOSS_TYPES as DPO_LOSS_TYPES
from .dpo import dpo_loss, dpo_objective, pair_share, reference_log_probs
from .grpo import _model_inputs, grpo_loss, grpo_objective, reference_completion_log_probs
from .log_probs import base_model_of, next_token_targets


def _shard(model) -> VocabShard:
    return VocabShard.of(base_model_of(model))  # on the last stage, where the head is


def _dpo(model, batch, num_microbatches, *, reference=None, beta=0.1, loss_type="sigmoid", num_pairs_in_batch=None):
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    rows = batch["input_ids"].shape[0]
    pairs = rows // 2
    if rows % 2 or pairs % num_microbatches:
        raise ValueError(f"a pipelined preference batch needs a multiple of num_microbatches={num_microbatches} "
                         f"pairs (whole pairs in each microbatch), got {rows} rows")
    if "ref_chosen_logps" in batch and "ref_rejected_logps" in batch:
        ref = torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]])
    elif reference is None:
        raise ValueError("pass a frozen reference model or precomputed ref_chosen_logps / ref_rejected_logps")
    else:
        ref = reference_log_probs(reference, batch)
    per = pairs // num_microbatches
    order = torch.cat([torch.cat([torch.arange(m * per, (m + 1) * per), pairs + torch.arange(m * per, (m + 1) * per)])
                       for m in range(num_microbatches)])
    inputs = {key: batch[key][order] for key in ("input_ids", "attention_mask") if batch.get(key) is not None}
    completion_mask = batch["completion_mask"][order]
    per_row = {"targets": next_token_targets(inputs["input_ids"], completion_mask), "ref": ref[order.to(ref.device)],
               "lengths": completion_mask.sum(-1).float()}
    share = num_pairs_in_batch if num_pairs_in_batch is not None else pair_share(pairs, model.parallel_context)

    def loss_fn(logits, mb):
        chosen, rejected = token_log_probs(logits, mb["targets"], shard=_shard(model)).sum(-1).chunk(2)
        ref_chosen, ref_rejected = mb["ref"].to(chosen).chunk(2)
        lengths = mb["lengths"].chunk(2)
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta, loss_type=loss_type,
                        chosen_lengths=lengths[0], rejected_lengths=lengths[1], num_pairs_in_batch=share)[0]

    return inputs, per_row, loss_fn


def _grpo(model, batch, num_microbatches, *, reference=None, beta=0.0, temperature=1.0, loss_type="grpo",
          num_items_in_batch=None, **loss_options):
    ref = batch.get("ref_per_token_logps")
    if beta and ref is None:
        if reference is None:
            raise ValueError("beta > 0 needs a frozen reference model or batch['ref_per_token_logps']")
        ref = reference_completion_log_probs(reference, batch, temperature=temperature)
    full = _model_inputs(batch)
    mask = batch["completion_mask"]
    rows, width = mask.shape
    per_row = {"targets": next_token_targets(full["input_ids"], full["completion_mask"]),
               "advantages": batch["advantages"], "mask": mask}
    for name, value in (("ref", ref), ("old", batch.get("old_per_token_logps"))):
        if value is not None:
            per_row[name] = value
    options = dict(loss_options, beta=beta, loss_type=loss_type)
    if loss_type in ("bnpo", "dapo"):  # token level: over the replica's (bnpo) or the given global share (dapo)
        share = num_items_in_batch if loss_type == "dapo" and num_items_in_batch is not None else mask.sum()
        options.update(loss_type="dapo", num_items_in_batch=torch.as_tensor(share).float().clamp(min=1.0))

    def loss_fn(logits, mb):
        log_probs = token_log_probs(logits, mb["targets"], shard=_shard(model), temperature=temperature)
        seq = log_probs.shape[1]
        log_probs = log_probs[:, seq - 1 - width:seq - 1]
        loss, _ = grpo_loss(log_probs, mb["advantages"], mb["mask"], old_per_token_logps=mb.get("old"),
                            ref_per_token_logps=mb.get("ref"), **options)
        if loss_type in ("grpo", "dr_grpo"):  # a mean over the microbatch's rows: weighted by its part of them
            loss = loss * (mb["mask"].shape[0] / rows)
        return loss

    return {key: full[key] for key in ("input_ids", "attention_mask")}, per_row, loss_fn


def _distill(model, batch, num_microbatches, *, teacher=None, top_k=None, alpha=0.5, direction="forward",
             temperature=1.0):
    if "teacher_values" in batch and "teacher_indices" in batch:
        values, indices = batch["teacher_values"], batch["teacher_indices"]
    elif teacher is None or top_k is None:
        raise ValueError("a pipelined student distills from top-k teacher logits: pass a frozen teacher with top_k, "
                         "or batch['teacher_values'] / ['teacher_indices'] (full teacher logits would cross the "
                         "pipeline)")
    else:
        values, indices = teacher_topk(teacher, batch, top_k)
    targets = next_token_targets(batch.get("labels", batch["input_ids"]), None)
    count = batch.get("num_items_in_batch")
    if count is None:
        count = global_share((targets != -100).sum(), model.parallel_context)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask") if batch.get(key) is not None}
    per_row = {"targets": targets, "values": values, "indices": indices}

    def loss_fn(logits, mb):
        return distillation_loss(logits, mb["targets"], shard=_shard(model), teacher_values=mb["values"],
                                 teacher_indices=mb["indices"], alpha=alpha, direction=direction,
                                 temperature=temperature, num_items_in_batch=count)[0]

    return inputs, per_row, loss_fn


BUILDERS = {dpo_objective: _dpo, grpo_objective: _grpo, distill_objective: _distill}


def pipeline_train_step(model, optimizer, objective, batch: dict, *, max_grad_norm: float | None = None,
                        **options) -> tuple[torch.Tensor, dict]:
    """``(global loss, metrics)`` of one step of ``objective`` (:func:`dpo_objective`, :func:`grpo_objective` or
    :func:`distill_objective`, with their keywords in ``options``) on a pipelined ``model`` (not wrapped: the runner
    averages gradients over dp itself) and this replica's ``batch``; ``optimizer`` stepped, gradients zeroed."""
    if objective not in BUILDERS:
        raise NotImplementedError(
            f"{getattr(objective, '__name__', objective)!r} has no pipelined form: a pipelined model runs "
            "dpo_objective, grpo_objective or distill_objective as its last stage's loss")
    runner = model._pipeline_runner()
    inputs, per_row, loss_fn = BUILDERS[objective](model, batch, runner.num_microbatches, **options)
    loss = model.train_step(inputs, loss_fn=loss_fn, loss_inputs=per_row)
    metrics = {}
    if max_grad_norm:
        metrics["grad_norm"] = training.clip_grad_norm_(model, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, metrics
