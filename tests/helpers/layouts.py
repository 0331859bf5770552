"""Training parity at any data x context x tensor layout: a parallel model's steps against single-process
``transformers`` on the whole batch.

``train_matches(model, reference, batch)``: data-parallel rank ``d`` trains on rows ``d::dp`` of ``batch``; under
context parallelism each rank takes its chunks (``ContextParallelSplitter``, targets shifted before the split, so
every rank's chunks reassemble to its replica's rows exactly: checked); the rank's batch carries the
``num_items_in_batch`` of ``training.prepare``'s loader, and the reference trains on the loss of the *global* batch
(``tests/helpers/global_loss.py``: summed token losses over every replica / their label count, plus any per-replica
router term). Each step compares the loss, this rank's logits (its chunks under cp), every local gradient and,
after AdamW, every local parameter (fp32, atol 1e-5). ``zero_stage``: the model is
wrapped by ``om.training.prepare`` (Accelerate's path: ZeRO 1-3 over the data-parallel group); else by
``shard_data_parallel`` (plain DDP semantics, a no-op at dp 1).
"""
from __future__ import annotations

import torch

from oslo_models import training
from oslo_models.data import ContextParallelSplitter
from oslo_models.parallel_layers.context_parallel import merge_sequence, split_sequence
from oslo_models.training.global_batch import loss_shifts_labels
from tests.helpers.global_loss import replica_loss, replica_weights, with_global_share
from tests.helpers.models import assert_grads_match, assert_params_match
from tests.helpers.pipeline import ADAMW


def local_batch(context, replica: dict, shift_labels: bool) -> dict:
    if context.cp_size == 1:
        return replica
    mode = context.config.context_parallel_mode
    splitter = ContextParallelSplitter(context, shift_labels=shift_labels)
    local = splitter(replica)
    whole = ContextParallelSplitter(cp_rank=0, cp_size=1, shift_labels=shift_labels)(replica)
    for key, value in local.items():  # the chunks of every rank reassemble to the replica's batch exactly
        if value.dim() < 2:  # per-row values (a sequence label, a span's ends) are not split
            continue
        parts = [torch.empty_like(value) for _ in range(context.cp_size)]
        torch.distributed.all_gather(parts, value, group=context.cp_group)
        assert torch.equal(merge_sequence(parts, mode), whole[key]), key
    return local


def train_matches(model, reference, batch: dict, *, zero_stage: int = 0, steps: int = 1, shift_labels: bool = True,
                  call: dict | None = None, outputs: tuple[str, ...] = ("logits",), chunked: bool = True,
                  max_grad_norm: float | None = None) -> tuple:
    """See the module docstring; returns ``(model, reference)`` after the steps (the model unwrapped).
    ``shift_labels``: causal LM targets (``False`` for masked LM); ``call``: extra keyword arguments of both
    forwards (e.g. ``use_cache=False``); ``outputs``: the output tensors compared, this rank's chunks of the
    reference's when ``chunked`` (else whole: a sequence classifier's pooled logits, a span head's gathered ones);
    ``max_grad_norm``: also clip both, the global norms and the clipped gradients equal."""
    call, names = call or {}, outputs
    context = model.parallel_context
    replicas = [{k: v[d::context.dp_size].contiguous() for k, v in batch.items()} for d in range(context.dp_size)]
    local = local_batch(context, replicas[context.dp_rank], shift_labels)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    if zero_stage:
        from accelerate import Accelerator

        model, opt = training.prepare(Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters(), **ADAMW),
                                      zero_stage=zero_stage)
    else:
        model, opt = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), **ADAMW))
    inner = training.unwrap_model(model)
    mode = context.config.context_parallel_mode
    # the label count follows the model's loss (transformers' rule: a causal LM's targets are shifted, an
    # encoder-decoder's are not), whatever the cp splitter was told
    shift = loss_shifts_labels(inner)
    local = with_global_share(inner, local, shift)
    weights = replica_weights(replicas, shift, inner)
    for _ in range(steps):
        outputs = [reference(**replica, **call) for replica in replicas]
        expected = outputs[context.dp_rank]
        losses = [replica_loss(out, replica, weight, shift, names[0] if names else "logits")
                  for out, replica, weight in zip(outputs, replicas, weights)]
        got = model(**local, **call)
        torch.testing.assert_close(got.loss, losses[context.dp_rank], atol=1e-5, rtol=1e-5)
        for name in names:
            expected_logits = expected[name]
            if context.cp_size > 1 and chunked:
                expected_logits = split_sequence(expected_logits, context.cp_rank, context.cp_size, mode)
            torch.testing.assert_close(got[name], expected_logits, atol=1e-5, rtol=1e-5)
        (sum(losses) / len(losses)).backward()
        got.loss.backward()
        assert assert_grads_match(inner, reference) == len(list(inner.parameters()))
        if max_grad_norm is not None:
            expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
            torch.testing.assert_close(training.clip_grad_norm_(model, max_grad_norm), expected_norm, atol=1e-5,
                                       rtol=1e-5)
            assert_grads_match(inner, reference)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
        assert_params_match(inner, reference)
    return inner, reference
