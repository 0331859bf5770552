import pytest
import torch
from transformers.activations import ACT2FN

from oslo_models.fused_ops import bias_gelu, bias_gelu_reference
from tests.fused_ops.checks import DEVICE, DTYPES, check_op, requires_triton


def _inputs(dtype, shape=(9, 341), bias=True):
    gen = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    b = torch.randn(shape[-1], generator=gen).to(DEVICE, dtype) if bias else None
    return [x, b]


# The transformers activations each approximation replaces: GPT-2's gelu_new and BERT's gelu.
_HF_ACT = {"tanh": "gelu_new", "none": "gelu"}


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", [(9, 341), (2, 3, 1000)])
def test_bias_gelu_matches_reference_and_transformers(dtype, approximate, shape):
    act = ACT2FN[_HF_ACT[approximate]]
    refs = {"reference": lambda x, b: bias_gelu_reference(x, b, approximate),
            f"transformers {_HF_ACT[approximate]}": lambda x, b: act(x + b)}
    check_op(lambda x, b: bias_gelu(x, b, approximate, force_triton=True), refs, _inputs(dtype, shape),
             grad_idx=[0, 1])


@requires_triton
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_without_bias(approximate):
    check_op(lambda x, b: bias_gelu(x, None, approximate, force_triton=True),
             {"F.gelu": lambda x, b: torch.nn.functional.gelu(x, approximate=approximate)},
             _inputs(torch.float32, bias=False), grad_idx=[0])


@requires_triton
def test_bias_gelu_opcheck():
    x, b = _inputs(torch.float32)
    for approximate in ("tanh", "none"):
        torch.library.opcheck(torch.ops.oslo_models.bias_gelu.default,
                              (x.clone().requires_grad_(), b.clone().requires_grad_(), approximate))
    torch.library.opcheck(torch.ops.oslo_models.bias_gelu_backward.default, (torch.randn_like(x), x, b, "none"))


def test_bias_gelu_rejects_bad_input():
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu(torch.randn(2, 4), None, "erf")
    with pytest.raises(ValueError, match="bias must have shape"):
        bias_gelu(torch.randn(2, 4), torch.randn(3))
