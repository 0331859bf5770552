import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from oslo_models.fused_ops import FusedRMSNorm, rms_norm, rms_norm_reference
from tests.fused_ops.checks import DEVICE, DTYPES, check_op, requires_triton


def _inputs(dtype, shape=(9, 341)):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen) * 2 + 0.3).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEVICE, dtype)
    return [x, w, 1e-6]


def _llama_fn(x, w, eps):
    mod = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.device, x.dtype)
    return torch.func.functional_call(mod, {"weight": w}, (x,))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 341), (2, 5, 1000), (3, 64)])
def test_rms_norm_matches_reference_and_llama(dtype, shape):
    check_op(lambda *a: rms_norm(*a, force_triton=True),
             {"reference": rms_norm_reference, "LlamaRMSNorm": _llama_fn}, _inputs(dtype, shape), grad_idx=[0, 1])


@requires_triton
def test_rms_norm_mixed_dtype_promotes_like_llama():
    x, w, eps = _inputs(torch.bfloat16)
    out = rms_norm(x, w.float(), eps, force_triton=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_reference(x.float(), w.float(), eps), atol=1e-5, rtol=1e-5)


@requires_triton
def test_rms_norm_opcheck():
    x, w, eps = _inputs(torch.float32)
    torch.library.opcheck(torch.ops.oslo_models.rms_norm.default, (x.requires_grad_(), w.requires_grad_(), eps))
    torch.library.opcheck(torch.ops.oslo_models.rms_norm_backward.default,
                          (torch.randn_like(x), x.detach(), w.detach(), eps))


def test_fused_rms_norm_module_matches_llama_state_dict():
    ref = LlamaRMSNorm(341, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    mod = FusedRMSNorm(341, eps=1e-6)
    assert mod.state_dict().keys() == ref.state_dict().keys()
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(9, 341)
    assert torch.equal(mod(x), ref(x))
