"""A dense single-process softmax attention with every score modification the context-parallel cores take, on the
whole sequence: the reference of the cores' own tests (``tests/parallel_layers/test_context_parallel_*.py``)."""
from __future__ import annotations

from dataclasses import replace

import torch

from oslo_models.parallel_layers.context_parallel import (
    all_to_all_attention,
    build_context_parallel_mask,
    split_sequence,
    with_alibi,
)
from oslo_models.parallel_layers.context_parallel.hybrid import hybrid_attention
from oslo_models.parallel_layers.context_parallel.ring import ring_attention

TOL = dict(atol=1e-5, rtol=1e-5)
CORES = {"ring": ring_attention, "all_to_all": all_to_all_attention, "hybrid": hybrid_attention}


def dense_attention(q, k, v, valid, documents, slopes, window, softcap, sinks, scaling):
    """Single-process reference on the whole sequence: ``q, k [b, n, S, d]``, ``v [b, n, S, d_v]``."""
    seq = q.shape[2]
    pos = torch.arange(seq)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    within = torch.stack([torch.cat([torch.arange(int((row == d).sum())) for d in row.unique()]) for row in documents])
    scores = scores + slopes[None, :, None, None] * (within * valid)[:, None, None, :]
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    allowed = allowed[None, None] & valid[:, None, None, :].bool() \
        & (documents[:, None, :, None] == documents[:, None, None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return torch.matmul(probs, v)


def check_core(context, mode: str, controls: dict, impl: str = "tiles") -> None:
    """ALiBi + soft-cap + sinks + window + padding + documents + ``d_v != d_qk`` through the core of ``mode``
    (its per-block kernel ``impl``: "tiles" or "flex") against ``dense_attention`` (output; q, k, v and sink
    gradients, 1e-5); each of ``controls`` (name -> ``f(core, mask, sinks, cp) -> (core, mask, sinks)``, a broken
    variant) must be > 1e-3 off."""
    torch.manual_seed(3)
    b, n, seq, d, dv, scaling, window, softcap = 2, 4, 16, 8, 6, 0.35, 5, 2.0
    q, k = torch.randn(b, n, seq, d), torch.randn(b, n, seq, d)
    v, weight = torch.randn(b, n, seq, dv), torch.randn(b, n, seq, dv)
    slopes, sinks = torch.rand(n), torch.randn(n)
    valid = torch.ones(b, seq, dtype=torch.long)
    valid[1, 11:] = 0
    documents = torch.zeros(b, seq, dtype=torch.long)
    documents[0, 6:] = 1  # row 0: two documents (6 + 10), row 1: one, padded
    cp, rank = context.cp_size, context.cp_rank
    local = (lambda t, dim=2: split_sequence(t, rank, cp, mode, dim=dim))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    expected = dense_attention(*leaves[:3], valid, documents, slopes, window, softcap, leaves[3], scaling)
    (expected * weight).sum().backward()

    def run(control: str | None = None):
        parts = [local(t.detach()).requires_grad_() for t in (q, k, v)]
        sink = sinks.clone().requires_grad_()
        # the row with documents has no padding mask in transformers' packed sense: build each row's mask alone
        mask = build_context_parallel_mask(context, local(valid, 1), parts[0].transpose(1, 2), causal=True)
        mask = replace(mask, document=torch.stack([split_sequence(documents, r, cp, mode) for r in range(cp)]))
        mask = with_alibi(mask, slopes, 1.0, batch=b)
        core, used = CORES[mode], sink
        if control is not None:
            core, mask, used = controls[control](core, mask, sink, cp)
        out = core(*parts, mask, scaling=scaling, window=window, softcap=softcap, sinks=used, impl=impl)
        return out, parts, sink

    out, parts, sink = run()
    torch.testing.assert_close(out, local(expected.detach()), **TOL)
    (out * local(weight)).sum().backward()
    for name, got, leaf in zip("qkv", parts, leaves):
        torch.testing.assert_close(got.grad, local(leaf.grad), **TOL, msg=lambda m, x=name: f"{mode} d{x}: {m}")
    torch.distributed.all_reduce(sink.grad, group=context.cp_group)  # each rank holds its queries' (heads') share
    torch.testing.assert_close(sink.grad, leaves[3].grad, **TOL)
    for control in controls:
        wrong, _, _ = run(control)
        gap = (wrong - local(expected.detach())).abs().max()
        gap = gap.reshape(1)
        torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX, group=context.cp_group)
        assert gap > 1e-3, (mode, control, gap)
