import pytest
import torch
import torch.distributed as dist

from oslo_models.fused_ops import cross_entropy, cross_entropy_reference
from tests.fused_ops.checks import DEVICE, DTYPES, check_op, requires_interpreter, requires_triton
from tests.helpers.dist import run_distributed


def _inputs(dtype, rows=9, vocab=4231, ignore=(2, 7), seed=8):
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(rows, vocab, generator=gen)).to(DEVICE, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[list(ignore)] = -100
    return logits, labels.to(DEVICE)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("sum", 0.1), ("none", 0.0), ("mean", 0.2)])
def test_cross_entropy_matches_f_cross_entropy(dtype, reduction, label_smoothing):
    logits, labels = _inputs(dtype)
    kw = dict(label_smoothing=label_smoothing, reduction=reduction)
    refs = {"reference": lambda x: cross_entropy_reference(x, labels, **kw),
            "F.cross_entropy": lambda x: torch.nn.functional.cross_entropy(x, labels, **kw)}
    check_op(lambda x: cross_entropy(x, labels, **kw, force_triton=True), refs, [logits], grad_idx=[0])


@requires_triton
def test_cross_entropy_3d_and_custom_ignore_index():
    logits, labels = _inputs(torch.float32, rows=10, vocab=37)
    labels = labels.where(labels != -100, 5).reshape(2, 5)
    labels[0, 1] = 5
    kw = dict(ignore_index=5, label_smoothing=0.05, reduction="none")
    check_op(lambda x: cross_entropy(x, labels, **kw, force_triton=True),
             {"F.cross_entropy": lambda x: torch.nn.functional.cross_entropy(x.transpose(1, 2), labels, **kw)},
             [logits.reshape(2, 5, 37)], grad_idx=[0])


@requires_triton
def test_cross_entropy_all_ignored_is_nan_like_torch():
    logits, labels = _inputs(torch.float32, rows=3, vocab=11, ignore=(0, 1, 2))
    assert torch.isnan(cross_entropy(logits, labels, force_triton=True))
    assert torch.isnan(torch.nn.functional.cross_entropy(logits, labels))


@requires_triton
def test_cross_entropy_opcheck():
    logits, labels = _inputs(torch.float32, vocab=301)
    torch.library.opcheck(torch.ops.oslo_models.cross_entropy_stats.default, (logits, labels, 0, -100))
    lse = torch.logsumexp(logits, -1)
    torch.library.opcheck(torch.ops.oslo_models.cross_entropy_backward.default,
                          (logits, labels, lse, torch.rand(9, device=logits.device), 0, 301, 0.1, -100))


def _vocab_parallel_worker(cases) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # A large vocabulary (several kernel blocks per row), then a small one at a tight tolerance: with V = 12 a
    # smoothing term over the wrong vocabulary (eps / V_local instead of eps / V) moves every gradient element by
    # eps / V ~ 1e-2 and the loss by ~1e-1, far above 1e-6; with V = 4230 the gradient error would hide under 1e-5.
    for vocab, tol in ((4230, 1e-5), (12, 1e-6)):
        logits, labels = _inputs(torch.float32, vocab=vocab)
        local_vocab = logits.shape[1] // world
        cols = slice(rank * local_vocab, (rank + 1) * local_vocab)
        for use_kernel, reduction, label_smoothing in cases:
            kw = dict(label_smoothing=label_smoothing, reduction=reduction)
            full = logits.clone().requires_grad_(True)
            ref = torch.nn.functional.cross_entropy(full, labels, **kw)
            shard = logits[:, cols].clone().requires_grad_(True)
            path = dict(force_triton=True) if use_kernel else dict(enabled=False)
            loss = cross_entropy(shard, labels, group=dist.group.WORLD, **path, **kw)
            torch.testing.assert_close(loss, ref, atol=tol, rtol=tol)
            dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0)).to(ref.device)
            ref.backward(dy)
            loss.backward(dy)
            torch.testing.assert_close(shard.grad, full.grad[:, cols], atol=tol, rtol=tol)
            # Invariants: each row's gradient sums to zero over the whole vocabulary (softmax, the smoothed
            # target and the uniform part each sum to the row's weight), and ignored rows get none.
            row_sums = shard.grad.sum(-1)
            dist.all_reduce(row_sums)
            torch.testing.assert_close(row_sums, torch.zeros_like(row_sums), atol=1e-6, rtol=0)
            assert torch.equal(shard.grad[labels == -100], torch.zeros_like(shard.grad[labels == -100]))


@pytest.mark.parametrize("use_kernel", [pytest.param(True, marks=requires_interpreter), False])
def test_vocab_parallel_cross_entropy_matches_full_logits(use_kernel):
    # Each of 2 ranks holds half the vocab; loss and the local grad slice must equal the full-logits torch op.
    cases = [(use_kernel, "mean", 0.1), (use_kernel, "none", 0.0), (use_kernel, "sum", 0.0), (use_kernel, "sum", 0.3),
             (use_kernel, "none", 0.2)]
    run_distributed(_vocab_parallel_worker, 2, cases, timeout=600)  # 127 s seen on a loaded CI box


def test_cross_entropy_rejects_bad_input():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="labels shape"):
        cross_entropy(logits, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long), label_smoothing=1.5)
