"""torch.compile traces through the registered ops (aot_eager: no C compiler needed on the CI box)."""
import pytest
import torch

from oslo_models import fused_ops
from tests.fused_ops.checks import DEVICE, requires_triton


@requires_triton
def test_compile_fullgraph_through_registered_ops():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 5, 34, generator=gen).to(DEVICE).requires_grad_(True)
    w, b = torch.randn(34, generator=gen).to(DEVICE), torch.randn(34, generator=gen).to(DEVICE)
    cos, sin = torch.randn(5, 34, generator=gen).to(DEVICE), torch.randn(5, 34, generator=gen).to(DEVICE)

    def block(x):
        h = fused_ops.layer_norm(x, w, b, force_triton=True)
        h = fused_ops.rms_norm(h, w, force_triton=True)
        h = fused_ops.bias_gelu(h, b, "none", force_triton=True)
        q, k = fused_ops.rotary_embedding(h, h, cos, sin, force_triton=True)
        scores = q @ k.transpose(-1, -2)
        return fused_ops.softmax(scores, scale=0.2, causal=True, force_triton=True)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    x2 = x.detach().clone().requires_grad_(True)
    ref = block(x2)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


@requires_triton
@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_compile_cross_entropy(op):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(9, 16, generator=gen).to(DEVICE).requires_grad_(True)
    w = torch.randn(37, 16, generator=gen).to(DEVICE)
    labels = torch.randint(0, 37, (9,), generator=gen).to(DEVICE)
    if op == "cross_entropy":
        fn = lambda h: fused_ops.cross_entropy(h @ w.t(), labels, label_smoothing=0.1, force_triton=True)  # noqa
    else:
        fn = lambda h: fused_ops.fused_linear_cross_entropy(h, w, labels, chunk_size=4, force_triton=True)  # noqa
    loss = torch.compile(fn, backend="aot_eager")(h)
    (grad,) = torch.autograd.grad(loss, h)
    h2 = h.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(h2 @ w.t(), labels, label_smoothing=0.1 if op == "cross_entropy" else 0.0)
    (ref_grad,) = torch.autograd.grad(ref, h2)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)
