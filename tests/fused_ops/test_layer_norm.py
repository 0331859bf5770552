import pytest
import torch
from torch import nn

from oslo_models.fused_ops import FusedLayerNorm, layer_norm, layer_norm_reference
from tests.fused_ops.checks import DEVICE, DTYPES, check_op, requires_triton


def _inputs(dtype, shape=(9, 341), bias=True):
    gen = torch.Generator().manual_seed(0)
    hidden = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    b = (0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype) if bias else None
    return [x, w, b, 1e-5]


def _module_fn(x, w, b, eps):
    mod = nn.LayerNorm(x.shape[-1], eps=eps, bias=b is not None, device=x.device, dtype=x.dtype)
    # functional_call runs the real module with the test's leaves as its parameters, so autograd reaches them.
    params = {"weight": w} if b is None else {"weight": w, "bias": b}
    return torch.func.functional_call(mod, params, (x,))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 341), (2, 5, 1000), (3, 64)])
def test_layer_norm_matches_reference_and_nn_layernorm(dtype, shape):
    refs = {"reference": layer_norm_reference, "nn.LayerNorm": _module_fn}
    check_op(lambda *a: layer_norm(*a, force_triton=True), refs, _inputs(dtype, shape), grad_idx=[0, 1, 2])


@requires_triton
def test_layer_norm_without_bias():
    check_op(lambda *a: layer_norm(*a, force_triton=True), {"reference": layer_norm_reference},
             _inputs(torch.float32, bias=False), grad_idx=[0, 1])


@requires_triton
def test_check_op_rejects_a_wrong_kernel():
    # Negative control: a 1% error in the output, or a wrong eps, must fail both comparison modes.
    for dtype in DTYPES:
        with pytest.raises(AssertionError):
            check_op(lambda *a: layer_norm(*a, force_triton=True) * 1.01, {"reference": layer_norm_reference},
                     _inputs(dtype), grad_idx=[0, 1, 2])
    inputs = _inputs(torch.float32, (9, 341))
    inputs[0] = inputs[0] * 1e-3  # small variance so eps matters
    with pytest.raises(AssertionError):
        check_op(lambda x, w, b, eps: layer_norm(x, w, b, 1e-2, force_triton=True),
                 {"reference": layer_norm_reference}, inputs, grad_idx=[0, 1, 2])


@requires_triton
def test_layer_norm_opcheck():
    x, w, b, eps = _inputs(torch.float32)
    torch.library.opcheck(torch.ops.oslo_models.layer_norm.default,
                          (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), eps))
    dy = torch.randn_like(x)
    torch.library.opcheck(torch.ops.oslo_models.layer_norm_backward.default, (dy, x.detach(), w.detach(), eps))


def test_fused_layer_norm_module_state_dict_and_fallback():
    ref = nn.LayerNorm(341, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    mod = FusedLayerNorm(341, eps=1e-6)
    assert set(mod.state_dict()) == {"weight", "bias"}
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(9, 341)
    # On CPU without force the dispatcher takes the reference, which is exactly nn.LayerNorm.
    assert torch.equal(mod(x), ref(x))


def test_layer_norm_rejects_bad_weight_shape():
    with pytest.raises(ValueError, match="weight/bias must have shape"):
        layer_norm(torch.randn(2, 8), torch.ones(7), None)
