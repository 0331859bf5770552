import pytest
import torch

from oslo_models.fused_ops import bias_dropout_add, bias_dropout_add_reference
from tests.fused_ops.checks import DEVICE, DTYPES, check_op, requires_triton


def _inputs(dtype, shape=(9, 341)):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    b = torch.randn(shape[-1], generator=gen).to(DEVICE, dtype)
    r = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return [x, b, r]


def _fused(p, seed, training=True):
    def run(x, b, r):
        gen = torch.Generator(device=x.device).manual_seed(seed)
        return bias_dropout_add(x, b, r, p, training, generator=gen, force_triton=True)
    return run


def _kernel_mask(x, b, p, seed):
    # With a zero residual and x + b != 0 everywhere, the output is nonzero exactly where the kernel kept.
    out = _fused(p, seed)(x, b, torch.zeros_like(x))
    assert ((x + b) != 0).all()
    return out != 0


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_bias_dropout_add_matches_reference_with_the_kernel_mask(dtype, p):
    inputs = _inputs(dtype)
    mask = _kernel_mask(inputs[0], inputs[1], p, seed=7)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.05
    # The grads of x and bias are dy * mask / (1 - p): they match only if the backward regenerates this mask.
    ref = {"reference with the forward's mask":
           lambda x, b, r: bias_dropout_add_reference(x, b, r, p, mask=mask)}
    check_op(_fused(p, seed=7), ref, inputs, grad_idx=[0, 1, 2])


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_without_dropout_matches_torch(dtype):
    torch_module = {"residual + F.dropout(x + b)":
                    lambda x, b, r: r + torch.nn.functional.dropout(x + b, 0.3, training=False)}
    check_op(_fused(0.3, seed=1, training=False), torch_module, _inputs(dtype), grad_idx=[0, 1, 2])
    check_op(_fused(0.0, seed=1), torch_module, _inputs(dtype), grad_idx=[0, 1, 2])


@requires_triton
def test_bias_dropout_add_seeds():
    x, b, _ = _inputs(torch.float32)
    assert torch.equal(_kernel_mask(x, b, 0.5, seed=3), _kernel_mask(x, b, 0.5, seed=3))
    assert not torch.equal(_kernel_mask(x, b, 0.5, seed=3), _kernel_mask(x, b, 0.5, seed=4))
    assert not _kernel_mask(x, b, 1.0, seed=3).any()


@requires_triton
def test_bias_dropout_add_opcheck():
    x, b, r = _inputs(torch.float32)
    seed = torch.tensor([1234], dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(torch.ops.oslo_models.bias_dropout_add.default,
                          (x.requires_grad_(), b.requires_grad_(), r.requires_grad_(), seed, 0.25))
    torch.library.opcheck(torch.ops.oslo_models.bias_dropout_add_backward.default,
                          (torch.randn_like(x), seed, 0.25))


def test_bias_dropout_add_rejects_bad_input():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        bias_dropout_add(x, None, x, 1.5)
    with pytest.raises(ValueError, match="residual shape"):
        bias_dropout_add(x, None, torch.randn(4, 2), 0.1)
