import pytest
import torch

from oslo_models.fused_ops import softmax, softmax_reference
from tests.fused_ops.checks import DEVICE, DTYPES, check_op, requires_triton


def _scores(dtype, shape, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)


def _right_padding(batch, k_len):
    lengths = torch.tensor([k_len, k_len - 7][:batch] + [k_len - 3] * max(0, batch - 2))
    return (torch.arange(k_len)[None, :] < lengths[:, None]).to(DEVICE)


def _hf_eager(scores, scale, causal, mask):
    # What HF eager attention does (GPT-2 style): scale, where(causal, s, min), add the additive padding mask.
    s = scores * scale
    q_len, k_len = s.shape[-2:]
    min_value = torch.finfo(s.dtype).min
    if causal:
        tri = torch.ones(q_len, k_len, dtype=torch.bool, device=s.device).tril(k_len - q_len)
        s = torch.where(tri, s, torch.full_like(s, min_value))
    if mask is not None:
        s = s + (1.0 - mask[:, None, None, :].to(s.dtype)) * min_value
    return torch.softmax(s, dim=-1)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,causal,padded", [
    ((2, 3, 9, 341), True, True),
    ((2, 3, 9, 341), False, False),
    ((1, 2, 5, 37), True, False),     # q_len < k_len: bottom-right causal (KV cache)
    ((2, 1, 13, 13), False, True),
])
def test_softmax_matches_reference_and_hf_eager(dtype, shape, causal, padded):
    scale = 0.125
    mask = _right_padding(shape[0], shape[-1]) if padded else None
    refs = {"reference": lambda s: softmax_reference(s, scale, causal, mask),
            "hf eager": lambda s: _hf_eager(s, scale, causal, mask)}
    check_op(lambda s: softmax(s, scale=scale, causal=causal, mask=mask, force_triton=True), refs,
             [_scores(dtype, shape)], grad_idx=[0])


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_4d_mask_with_fully_masked_rows(dtype):
    shape = (2, 3, 9, 41)
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(2, 1, 9, 41, generator=gen) > 0.4).to(DEVICE)
    mask[0, 0, 4] = False  # a query that sees nothing
    scores = _scores(dtype, shape)
    check_op(lambda s: softmax(s, scale=0.3, causal=True, mask=mask, force_triton=True),
             {"reference": lambda s: softmax_reference(s, 0.3, True, mask)}, [scores], grad_idx=[0])
    s = scores.detach().clone().requires_grad_(True)
    probs = softmax(s, scale=0.3, causal=True, mask=mask, force_triton=True)
    probs.backward(torch.randn_like(probs))
    assert torch.isfinite(s.grad).all()
    assert probs[0, :, 4].abs().sum() == 0 and s.grad[0, :, 4].abs().sum() == 0
    assert (probs.masked_select(~mask.expand(shape)) == 0).all()


@requires_triton
def test_softmax_opcheck():
    scores = _scores(torch.float32, (2, 2, 5, 37))
    mask = _right_padding(2, 37)[:, None, None, :].expand(2, 2, 5, 37)
    torch.library.opcheck(torch.ops.oslo_models.masked_softmax.default,
                          (scores.requires_grad_(), mask, 0.5, True))
    y = torch.softmax(scores.detach(), -1)
    torch.library.opcheck(torch.ops.oslo_models.masked_softmax_backward.default, (torch.randn_like(y), y, 0.5))


def test_softmax_rejects_bad_input():
    with pytest.raises(ValueError, match="batch, heads"):
        softmax(torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="does not broadcast"):
        softmax(torch.randn(2, 1, 3, 5), mask=torch.ones(3, 5, dtype=torch.bool))
