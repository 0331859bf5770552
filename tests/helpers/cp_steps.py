"""Training a context-parallel model and its single-process reference the same way, step by step.

The cp tests that drive the chunks by hand (no ``training.prepare``): each rank's chunk loss is backpropagated, the
gradients averaged over the cp group (what data parallelism over dp x cp does; the model is marked as reduced by the
caller), then one AdamW step; the reference runs the whole rows. :func:`assert_run_matches` compares every step's loss
and every parameter after the steps.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)  # Adam divides by sqrt(v): float noise of tiny gradients is amplified


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def reference_run(model, batches: Iterable[dict]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """``(losses, parameters after the steps)`` of ``model`` trained one AdamW step per batch (keyword dicts)."""
    opt, losses = adamw(model.parameters()), []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def cp_run(model, local_batches: Iterable[dict]) -> list[torch.Tensor]:
    """This rank's chunk losses of one AdamW step per batch, gradients averaged over the cp group (all-reduce in
    the backward's wake, / cp)."""
    context, opt, losses = model.parallel_context, adamw(model.parameters()), []
    for local in local_batches:
        loss = model(**local).loss
        loss.backward()
        for param in model.parameters():  # what data parallelism over dp x cp does
            torch.distributed.all_reduce(param.grad, group=context.cp_group)
            param.grad /= context.cp_size
        opt.step(), opt.zero_grad()
        losses.append(loss.detach())
    return losses


def assert_run_matches(label: str, model, losses, ref_losses, ref_params) -> None:
    """Every step's loss and every parameter after the steps equal the reference's (``TOL`` / ``PARAM_TOL``)."""
    for step, (got, expected) in enumerate(zip(losses, ref_losses, strict=True)):
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m, s=step: f"{label} loss {s}: {m}")
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), ref_params[name], **PARAM_TOL,
                                   msg=lambda m, n=name: f"{label} {n}: {m}")
