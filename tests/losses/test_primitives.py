"""``om.losses``: every vocabulary-parallel primitive against single-process torch on the whole vocabulary.

One 4-rank world runs tp 4 and tp 2 (x dp 2) over a vocabulary of 13 (padded to 16 and 14: the last rank holds
padded ``-inf`` columns), with ``-100`` targets, a temperature, bf16 logits, and chunks smaller than the batch (the
chunk loop is exercised). Forward values and gradients (of a random weighting of the outputs) are compared in fp32 at
1e-5. Negative controls run the library on the wrong input: a KL and a log-softmax computed on this rank's columns
alone (``VocabShard()``, the local vocabulary only), and a shard with the wrong ``vocab_start``, must differ.

The model-level check (a tiny Llama at tp 2 with and without sequence parallelism: the log-probabilities of the
vocab-split logits ``gather_logits=False`` equal plain ``transformers``' and so do the weights' gradients) lives in
``test_model_log_probs.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import oslo_models as om
from oslo_models.losses import (
    VocabShard,
    kl_divergence,
    token_entropy,
    token_log_probs,
    token_statistics,
    topk_kl_divergence,
    topk_logits,
)
from tests.helpers.dist import run_distributed

VOCAB, BATCH, SEQ, K = 13, 3, 5, 4
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(BATCH, SEQ, VOCAB, generator=g) * 3
    teacher = torch.randn(BATCH, SEQ, VOCAB, generator=g) * 3
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets[1, :3] = student[1, :3].argmax(-1)  # is_top1 true on some rows
    targets[0, :2] = -100
    targets[2, 4] = -100
    weights = torch.randn(BATCH, SEQ, generator=g)
    return student, teacher, targets, weights


def _local(full: torch.Tensor, ctx) -> tuple[torch.Tensor, VocabShard]:
    """This rank's columns of ``full [..., V]``, padded with ``-inf`` to a multiple of tp, and its shard."""
    tp = ctx.tp_size
    per_rank = -(-VOCAB // tp)
    padded = torch.cat([full, full.new_full((*full.shape[:-1], per_rank * tp - VOCAB), float("-inf"))], dim=-1)
    start = ctx.tp_rank * per_rank
    return padded[..., start:start + per_rank].contiguous(), VocabShard(ctx.tp_group, start, VOCAB)


def _grad_of(fn, x: torch.Tensor, weights: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    (out * weights).sum().backward()
    return out.detach(), x.grad


def _check_grad(local_grad: torch.Tensor, full_grad: torch.Tensor, shard: VocabShard, msg: str) -> None:
    num_local = local_grad.shape[-1]
    real = max(0, min(num_local, VOCAB - shard.vocab_start))
    expected = full_grad[..., shard.vocab_start:shard.vocab_start + real]
    torch.testing.assert_close(local_grad[..., :real].float(), expected, **TOL, msg=msg)
    assert torch.all(local_grad[..., real:] == 0), f"{msg}: padded columns got a gradient"


def _reference(student, teacher, targets, temperature):
    log_q = F.log_softmax(student / temperature, -1)
    log_p = F.log_softmax(teacher / temperature, -1)
    return log_q, log_p


def _check_layout(ctx, temperature: float, chunk: int) -> None:
    student, teacher, targets, weights = _inputs()
    local_s, shard = _local(student, ctx)
    local_t, _ = _local(teacher, ctx)

    # log-probabilities of the targets (-100: 0, no gradient)
    def ref_logp(x):
        log_q = F.log_softmax(x / temperature, -1)
        picked = log_q.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return torch.where(targets != -100, picked, torch.zeros(()))

    expected, expected_grad = _grad_of(ref_logp, student, weights)
    got, grad = _grad_of(lambda x: token_log_probs(x, targets, shard=shard, temperature=temperature,
                                                   chunk_size=chunk), local_s, weights)
    torch.testing.assert_close(got, expected, **TOL)
    _check_grad(grad, expected_grad, shard, "log_probs grad")

    # entropy
    def ref_entropy(x):
        log_q = F.log_softmax(x / temperature, -1)
        return -(log_q.exp() * log_q).sum(-1)

    expected, expected_grad = _grad_of(ref_entropy, student, weights)
    got, grad = _grad_of(lambda x: token_entropy(x, shard=shard, temperature=temperature, chunk_size=chunk),
                         local_s, weights)
    torch.testing.assert_close(got, expected, **TOL)
    _check_grad(grad, expected_grad, shard, "entropy grad")

    # log-probs and entropy together, and TRL's logged statistics
    x = local_s.detach().clone().requires_grad_(True)
    stats = token_statistics(x, targets, shard=shard, temperature=temperature, chunk_size=chunk)
    (stats["log_probs"] * weights + stats["entropy"] * weights.flip(0)).sum().backward()
    xr = student.detach().clone().requires_grad_(True)
    (ref_logp(xr) * weights + ref_entropy(xr) * weights.flip(0)).sum().backward()
    _check_grad(x.grad, xr.grad, shard, "log_probs + entropy grad")
    z = student / temperature
    log_q = F.log_softmax(z, -1)
    torch.testing.assert_close(stats["mean_logits"], z.mean(-1), **TOL)
    torch.testing.assert_close(stats["log_sum_sq_probs"], (2 * log_q).exp().sum(-1).log(), **TOL)
    assert torch.equal(stats["is_top1"], (z.argmax(-1) == targets) & (targets != -100))
    assert stats["is_top1"].any() and not stats["is_top1"].all()

    # KL both ways, full teacher on the same split
    log_p = F.log_softmax(teacher / temperature, -1)
    for direction in ("forward", "reverse"):
        def ref_kl(x, direction=direction):
            lq = F.log_softmax(x / temperature, -1)
            if direction == "forward":
                return (log_p.exp() * (log_p - lq)).sum(-1)
            return (lq.exp() * (lq - log_p)).sum(-1)

        expected, expected_grad = _grad_of(ref_kl, student, weights)
        got, grad = _grad_of(lambda x, direction=direction: kl_divergence(
            x, local_t, direction=direction, shard=shard, temperature=temperature, chunk_size=chunk), local_s, weights)
        torch.testing.assert_close(got, expected, **TOL, msg=direction)
        _check_grad(grad, expected_grad, shard, f"{direction} KL grad")
        # negative control: the same KL over this rank's columns only
        local_only = kl_divergence(local_s, local_t, direction=direction, temperature=temperature)
        assert (local_only - expected).abs().max() > 1e-2, f"{direction} KL on the local vocabulary matched"

    # top-k logits and KL against them
    values, ids = topk_logits(local_s, K, shard=shard)
    ref_values, ref_ids = student.topk(K, dim=-1)
    torch.testing.assert_close(values, ref_values, atol=0, rtol=0)
    assert torch.equal(ids, ref_ids)
    t_values, t_ids = topk_logits(local_t, K, shard=shard)
    log_pk = F.log_softmax(t_values / temperature, -1)
    for direction in ("forward", "reverse"):
        def ref_topk(x, direction=direction):
            lq = F.log_softmax(x / temperature, -1).gather(-1, t_ids)
            if direction == "forward":
                return (log_pk.exp() * (log_pk - lq)).sum(-1)
            log_r = F.log_softmax((x / temperature).gather(-1, t_ids), -1)
            return (log_r.exp() * (log_r - log_pk)).sum(-1)

        expected, expected_grad = _grad_of(ref_topk, student, weights)
        got, grad = _grad_of(lambda x, direction=direction: topk_kl_divergence(
            x, t_values, t_ids, direction=direction, shard=shard, temperature=temperature, chunk_size=chunk),
            local_s, weights)
        torch.testing.assert_close(got, expected, **TOL, msg=f"top-k {direction}")
        _check_grad(grad, expected_grad, shard, f"top-k {direction} KL grad")
    # with k = V the top-k forward KL is the full one
    all_values, all_ids = topk_logits(local_t, VOCAB, shard=shard)
    full = topk_kl_divergence(local_s, all_values, all_ids, shard=shard, temperature=temperature)
    torch.testing.assert_close(full, kl_divergence(local_s, local_t, shard=shard, temperature=temperature), **TOL)

    # bf16 logits: fp32 results from bf16 inputs, gradients in bf16
    got = token_log_probs(local_s.bfloat16(), targets, shard=shard, temperature=temperature, chunk_size=chunk)
    torch.testing.assert_close(got, ref_logp(student.bfloat16().float()), **TOL)

    # negative controls: the local vocabulary only, and a shard naming other columns
    if ctx.tp_size > 1:
        local_only = token_log_probs(local_s, targets, shard=VocabShard(vocab_start=shard.vocab_start),
                                     temperature=temperature)
        assert (local_only - ref_logp(student)).abs().max() > 1e-2
        shifted = VocabShard(ctx.tp_group, (shard.vocab_start + 1) % VOCAB, VOCAB)
        wrong = token_log_probs(local_s, targets, shard=shifted, temperature=temperature)
        assert (wrong - ref_logp(student)).abs().max() > 1e-2


def _worker() -> None:
    for tp in (4, 2):
        ctx = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=tp))
        for temperature, chunk in ((1.0, 4), (0.7, None)):
            _check_layout(ctx, temperature, chunk)


def test_primitives_match_full_vocabulary_at_tp2_and_tp4():
    run_distributed(_worker, 4)


def test_single_process_and_user_errors():
    import pytest

    student, teacher, targets, weights = _inputs()
    torch.testing.assert_close(token_log_probs(student, targets),
                               torch.where(targets != -100, F.log_softmax(student, -1).gather(
                                   -1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1), torch.zeros(())), **TOL)
    with pytest.raises(ValueError, match="targets"):
        token_log_probs(student, targets[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(student, temperature=0.0)
    with pytest.raises(ValueError, match="direction"):
        kl_divergence(student, teacher, direction="sideways")
    with pytest.raises(ValueError, match="differ"):
        kl_divergence(student, teacher[..., :-1])
    with pytest.raises(ValueError, match="k must be"):
        topk_logits(student, VOCAB + 1)
    with pytest.raises(ValueError, match="Unknown output"):
        token_statistics(student, targets, outputs=("logits",))
