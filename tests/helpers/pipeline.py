"""Pipeline parity: ``train_step``/``eval_step`` of a pipelined model against the single-process reference."""
from __future__ import annotations

from typing import Callable

import torch

from oslo_models.training import clip_grad_norm_
from tests.helpers.models import assert_grads_match, assert_params_match


def local_rows(context, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This data-parallel replica's rows of a global batch (replicas take equal, consecutive chunks)."""
    return {name: t.chunk(context.dp_size)[context.dp_rank] for name, t in tensors.items()}


# eps 1e-5: Adam's first step is ``lr * g / (|g| + eps)``, so a gradient of ~eps with fp32 noise (~1e-7 of a sum
# reordered across ranks) moves a parameter by up to ``lr * noise / (4 eps)``: 1e-6 turns that into 2e-5 misses
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-5)


def assert_pipeline_matches(model, reference, batch: dict[str, torch.Tensor], *, steps: int = 3,
                            reference_loss: Callable | None = None, optimizer=None,
                            max_grad_norm: float | None = None, reference_optimizer=None,
                            local: dict | None = None) -> None:
    """``steps`` AdamW steps through ``model.train_step`` equal the reference's: loss, every local gradient and
    every local parameter after each step (fp32, atol 1e-5); then ``eval_step`` equals the reference's loss.

    ``batch``: the global batch (every replica's rows); ``reference_loss(reference, batch)`` computes the
    reference loss (default: ``reference(**batch).loss``). The model must be pipelined already. ``optimizer`` /
    ``reference_optimizer``: the optimizers to step (default: fresh AdamW on each). ``local``: this rank's batch
    when it is not just its replica's rows (its context-parallel chunks).
    """
    reference_loss = reference_loss or (lambda ref, b: ref(**b).loss)
    local = local_rows(model.parallel_context, batch) if local is None else local
    ref_opt = reference_optimizer or torch.optim.AdamW(reference.parameters(), **ADAMW)
    opt = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), **ADAMW)
    num_params = len(list(model.parameters()))
    for _ in range(steps):
        expected = reference_loss(reference, batch)
        expected.backward()
        loss = model.train_step(local)
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
        assert assert_grads_match(model, reference) == num_params
        if max_grad_norm is not None:
            expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
            torch.testing.assert_close(clip_grad_norm_(model, max_grad_norm), expected_norm, atol=1e-5, rtol=1e-5)
            assert assert_grads_match(model, reference) == num_params
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
        assert_params_match(model, reference)
    with torch.no_grad():
        expected = reference_loss(reference, batch)
    torch.testing.assert_close(model.eval_step(local), expected, atol=1e-5, rtol=1e-5)
