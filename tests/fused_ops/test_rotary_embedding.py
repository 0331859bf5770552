import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from oslo_models.fused_ops import rotary_embedding, rotary_embedding_reference
from tests.fused_ops.checks import DEVICE, DTYPES, check_op, requires_triton


def _cos_sin(batch, seq, head_dim, dtype, per_batch=True):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.arange(seq)[None, :] + torch.tensor([0, 5][:batch])[:, None]  # per-sample offsets
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    return (cos, sin) if per_batch else (cos[0], sin[0])


def _qk(dtype, batch=2, heads_q=3, heads_k=1, seq=9, head_dim=34, layout_bhsd=True):
    gen = torch.Generator().manual_seed(6)
    shape_q = (batch, heads_q, seq, head_dim) if layout_bhsd else (batch, seq, heads_q, head_dim)
    shape_k = (batch, heads_k, seq, head_dim) if layout_bhsd else (batch, seq, heads_k, head_dim)
    return (torch.randn(shape_q, generator=gen).to(DEVICE, dtype),
            torch.randn(shape_k, generator=gen).to(DEVICE, dtype))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,unsqueeze_dim,per_batch", [(34, 1, True), (128, 1, False), (34, 2, True)])
def test_rotary_matches_reference_and_transformers(dtype, head_dim, unsqueeze_dim, per_batch):
    q, k = _qk(dtype, head_dim=head_dim, layout_bhsd=unsqueeze_dim == 1)
    cos, sin = _cos_sin(2, 9, head_dim, dtype, per_batch)
    cos3, sin3 = (cos, sin) if per_batch else (cos[None], sin[None])  # HF wants [batch, seq, head_dim]
    refs = {"reference": lambda q, k: rotary_embedding_reference(q, k, cos, sin, unsqueeze_dim),
            "transformers apply_rotary_pos_emb": lambda q, k: apply_rotary_pos_emb(q, k, cos3, sin3,
                                                                                   unsqueeze_dim=unsqueeze_dim)}
    check_op(lambda q, k: rotary_embedding(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, force_triton=True),
             refs, [q, k], grad_idx=[0, 1])


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_inplace_matches_out_of_place(dtype):
    q, k = _qk(dtype)
    cos, sin = _cos_sin(2, 9, 34, dtype)

    def inplace(q, k):
        # Rotate non-leaf copies in place (as attention does on the fresh q/k projections).
        q2, k2 = q * 1, k * 1
        out_q, out_k = rotary_embedding(q2, k2, cos, sin, inplace=True, force_triton=True)
        assert out_q is q2 and out_k is k2
        return out_q, out_k

    check_op(inplace, {"reference": lambda q, k: rotary_embedding_reference(q, k, cos, sin)}, [q, k],
             grad_idx=[0, 1])


@requires_triton
def test_rotary_opcheck():
    q, _ = _qk(torch.float32)
    cos, sin = _cos_sin(2, 9, 34, torch.float32)
    torch.library.opcheck(torch.ops.oslo_models.rotary_embedding.default, (q.requires_grad_(), cos, sin, False))
    torch.library.opcheck(torch.ops.oslo_models.rotary_embedding_.default, (q.detach().clone(), cos, sin, True))


def test_rotary_rejects_bad_input():
    q, k = _qk(torch.float32, head_dim=33)
    cos, sin = _cos_sin(2, 9, 34, torch.float32)
    with pytest.raises(ValueError, match="even"):
        rotary_embedding(q, k, cos[..., :33], sin[..., :33])
    q, k = _qk(torch.float32)
    with pytest.raises(ValueError, match="cos/sin must be"):
        rotary_embedding(q, k, cos[:, :5], sin[:, :5])
    with pytest.raises(ValueError, match="constants"):
        rotary_embedding(q, k, cos.requires_grad_(), sin)
