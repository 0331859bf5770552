import pytest
import torch
import torch.distributed as dist

from oslo_models.fused_ops import fused_linear_cross_entropy, fused_linear_cross_entropy_reference
from tests.fused_ops.checks import DEVICE, DTYPES, check_op, requires_interpreter, requires_triton
from tests.helpers.dist import run_distributed


def _inputs(dtype, rows=9, hidden=64, vocab=4231, seed=9):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype)
    w = (0.2 * torch.randn(vocab, hidden, generator=gen)).to(DEVICE, dtype)
    b = (0.1 * torch.randn(vocab, generator=gen)).to(DEVICE, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[[1, 6]] = -100
    return h, w, b, labels.to(DEVICE)


def _linear_ce(h, w, b, labels, **kw):
    # The modules this replaces: an nn.Linear LM head followed by F.cross_entropy on the full logits.
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), labels, **kw)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction,label_smoothing,chunk_size", [("mean", 0.0, None), ("sum", 0.1, 4),
                                                                  ("mean", 0.1, 9)])
def test_flce_matches_linear_plus_cross_entropy(dtype, reduction, label_smoothing, chunk_size):
    h, w, b, labels = _inputs(dtype)
    kw = dict(label_smoothing=label_smoothing, reduction=reduction)
    refs = {"reference": lambda h, w, b: fused_linear_cross_entropy_reference(h, w, labels, bias=b, **kw),
            "nn.Linear + F.cross_entropy": lambda h, w, b: _linear_ce(h, w, b, labels, **kw)}
    check_op(lambda h, w, b: fused_linear_cross_entropy(h, w, labels, bias=b, chunk_size=chunk_size,
                                                        force_triton=True, **kw),
             refs, [h, w, b], grad_idx=[0, 1, 2], unit_dy=dtype != torch.float32)
    # In bf16 the upstream grad is 1 (loss.backward()): with another value the stored half-precision hidden
    # grad takes one extra rounding (documented in fused_linear_cross_entropy.py); fp32 uses a random one.


@requires_triton
def test_flce_without_bias_3d_hidden():
    h, w, _, labels = _inputs(torch.float32, rows=10)
    h, labels = h.reshape(2, 5, -1), labels.reshape(2, 5)
    check_op(lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_size=3, force_triton=True),
             {"nn.Linear + F.cross_entropy": lambda h, w: _linear_ce(h.reshape(10, -1), w, None,
                                                                     labels.reshape(10))},
             [h, w], grad_idx=[0, 1])


def _vocab_parallel_worker(use_kernel: bool) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    h, w, b, labels = _inputs(torch.float32, vocab=4230)
    local = w.shape[0] // world
    rows = slice(rank * local, (rank + 1) * local)
    for reduction, smoothing in [("mean", 0.1), ("sum", 0.0)]:
        kw = dict(label_smoothing=smoothing, reduction=reduction)
        full = [t.clone().requires_grad_(True) for t in (h, w, b)]
        ref = _linear_ce(*full, labels, **kw)
        ref.backward()
        mine = [h.clone(), w[rows].clone(), b[rows].clone()]
        mine = [t.requires_grad_(True) for t in mine]
        path = dict(force_triton=True, chunk_size=4) if use_kernel else dict(enabled=False)
        loss = fused_linear_cross_entropy(mine[0], mine[1], labels, bias=mine[2], group=dist.group.WORLD,
                                          **path, **kw)
        loss.backward()
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine[0].grad, full[0].grad, atol=1e-5, rtol=1e-5)  # all-reduced in backward
        torch.testing.assert_close(mine[1].grad, full[1].grad[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine[2].grad, full[2].grad[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", [pytest.param(True, marks=requires_interpreter), False])
def test_vocab_parallel_flce_matches_full_head(use_kernel):
    run_distributed(_vocab_parallel_worker, 2, use_kernel)


def test_flce_rejects_bad_input():
    h, w, b, labels = _inputs(torch.float32, vocab=11)
    with pytest.raises(ValueError, match="reduction='none'"):
        fused_linear_cross_entropy(h, w, labels, reduction="none")
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_cross_entropy(h, w.t(), labels)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(h, w, labels, chunk_size=0)


def test_model_head_loss_under_bf16_autocast_matches_autocast_linear():
    """What a mixed-precision training step runs (accelerate's bf16 autocast, fp32 weights, fp32 hidden states out
    of the final norm): the chunked head loss equals F.linear + cross-entropy under the same autocast, gradients
    reaching the fp32 weight and hidden states through the cast."""
    from oslo_models.fused_ops import linear_cross_entropy_loss

    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    weight = torch.randn(37, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 7))
    labels[0, :2] = -100
    results = []
    for fused in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                loss = linear_cross_entropy_loss(hidden, weight, labels, chunk_size=3)
            else:
                logits = torch.nn.functional.linear(hidden, weight)
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        grads = torch.autograd.grad(loss, (hidden, weight))
        assert all(g.dtype == torch.float32 for g in grads)
        results.append((loss.detach(), *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
