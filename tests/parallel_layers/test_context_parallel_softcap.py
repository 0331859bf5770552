"""Gemma 2's attention logit soft-capping under context parallelism (a refusal lifted, issue 52): the ring and the
all-to-all cores cap the scores inside each block (``c * tanh(s / c)`` before the mask; the ring's backward through
``1 - tanh^2``), so 3 AdamW steps at cp 2 give the losses and the parameters of ``transformers``.

One spawned world of 2 gloo processes: Gemma 2's tiny record (cap 0.5, which caps at its initializer range;
sliding window 3 on alternate layers; the final logit cap), padded rows of 12 tokens, ring then all-to-all.
The chunks' gradients are averaged over cp as data parallelism over dp x cp does. Negative control: the same model
with the cap taken off its attention modules (library code running Gemma 2 without it) is off at the first step.
"""
from __future__ import annotations

import torch

import oslo_models as om
from oslo_models.data import ContextParallelSplitter
from tests.helpers.decoders import hf_class, save_tiny
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import padded_batch

TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)  # Adam divides by sqrt(v): float noise of tiny gradients is amplified
STEPS = 3


def _batches():
    return [padded_batch(101, batch=2, seq=12, seed=seed) for seed in range(STEPS)]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def reference(path):
    model = hf_class("gemma2").from_pretrained(path, attn_implementation="eager").train()
    opt, losses = _adamw(model.parameters()), []
    for ids, mask, labels in _batches():
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(path, mode, steps, *, cap=True):
    model = om.AutoModelForCausalLM.from_pretrained(path, progress=False, parallel=om.ParallelConfig(
        context_parallel_size=2, context_parallel_mode=mode)).train()
    if not cap:
        for layer in model.model.layers:
            layer.self_attn.softcap = None
    om.distributed.mark_gradients_reduced(model, "caller")  # the chunks' gradients are averaged below
    context, opt, losses = model.parallel_context, _adamw(model.parameters()), []
    for ids, mask, labels in _batches()[:steps]:
        local = ContextParallelSplitter(context, shift_labels=True)(dict(input_ids=ids, attention_mask=mask,
                                                                         labels=labels))
        loss = model(**local).loss
        loss.backward()
        for param in model.parameters():  # what data parallelism over dp x cp does
            torch.distributed.all_reduce(param.grad, group=context.cp_group)
            param.grad /= context.cp_size
        opt.step(), opt.zero_grad()
        losses.append(loss.detach())
    return model, losses


def _worker(path, ref_losses, ref_params):
    for mode in ("ring", "all_to_all"):
        breadcrumb(mode)
        model, losses = _train(path, mode, STEPS)
        for step, (got, expected) in enumerate(zip(losses, ref_losses)):
            torch.testing.assert_close(got, expected, **TOL, msg=lambda m, s=step: f"{mode} loss {s}: {m}")
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.detach(), ref_params[name], **PARAM_TOL,
                                       msg=lambda m, n=name: f"{mode} {n}: {m}")
        _, uncapped = _train(path, mode, 1, cap=False)
        assert (uncapped[0] - ref_losses[0]).abs() > 1e-4, (mode, uncapped[0], ref_losses[0])


def test_gemma2_softcap_trains_at_cp2(tmp_path):
    path = save_tiny(tmp_path / "gemma2", "gemma2")
    losses, params = reference(path)
    run_distributed(_worker, 2, path, losses, params, timeout=900)
