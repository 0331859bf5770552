"""Ring attention: each rank keeps its queries and passes key/value blocks around the context-parallel ring.

Forward, on rank ``r`` of ``cp``, step ``j = 0 .. cp-1`` (``src = r - j``): send the key/value block it holds to
``r + 1`` and receive the next from ``r - 1`` (``batch_isend_irecv``, started before the block's compute so the
transfer overlaps it), attend its queries to block ``src`` and merge into the running output with the block's
log-sum-exp (online softmax, fp32). Blocks a causal mask hides completely are skipped.

Backward (recompute, flash-attention style): the same ring again; per block the probabilities are rebuilt from the
saved log-sum-exp, ``dQ`` accumulates locally and ``dK``/``dV`` accumulators travel *with* their block, so after
``cp`` hops (one more than the key/value blocks make) every rank holds the full gradient of its own key/value.

Communication per layer and rank (``b`` batch, ``n_kv`` key/value heads on this rank, ``s`` local length, ``d``
head dim, ``e`` bytes per element): forward ``(cp-1) * 2*b*n_kv*s*d*e``; backward the same for key/value plus
``cp * 2*b*n_kv*s*d*4`` for the fp32 gradients. Arithmetic in fp32 whatever the input dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .mask import ContextParallelMask


def _start_exchange(tensor: torch.Tensor, mask: ContextParallelMask):
    """Send ``tensor`` to the next rank of the ring, receive the same shape from the previous; returns
    ``(buffer, requests)``: wait on the requests before reading the buffer."""
    tensor = tensor.contiguous()
    buffer = torch.empty_like(tensor)
    nxt, prev = mask.ranks[(mask.rank + 1) % mask.size], mask.ranks[(mask.rank - 1) % mask.size]
    ops = [dist.P2POp(dist.isend, tensor, nxt, mask.group), dist.P2POp(dist.irecv, buffer, prev, mask.group)]
    return buffer, dist.batch_isend_irecv(ops)


def _finish(buffer: torch.Tensor, requests) -> torch.Tensor:
    for request in requests:
        request.wait()
    return buffer


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads ``[b, n_kv, s, d]`` repeated for their ``groups`` query heads (``transformers``' repeat_kv)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of ``_expand`` for gradients: sum over each key/value head's query heads."""
    if groups == 1:
        return grad
    b, n, s, d = grad.shape
    return grad.view(b, n // groups, groups, s, d).sum(2)


def _scores(q, k, allowed, scaling):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows that see no key) replaced by 0, so ``exp(-inf - lse)`` is 0, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _block_forward(q, k, v, allowed, scaling):
    scores = _scores(q, k, allowed, scaling)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - _finite(lse)[..., None]), v), lse


def _merge(out, lse, block_out, block_lse):
    """Online-softmax merge of two partial attentions over disjoint key sets."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], new


def _blocks(mask: ContextParallelMask, window):
    """``(src, allowed)`` for each ring step, ``allowed`` ``False`` when the block is hidden entirely."""
    q_index, _, q_document = mask.keys_of(mask.rank)
    for step in range(mask.size):
        k_index, k_valid, k_document = mask.keys_of((mask.rank - step) % mask.size)
        allowed = mask.allowed(q_index, k_index, k_valid, window, q_document, k_document)
        if allowed is not None and not bool(allowed.any()):
            allowed = False
        yield step, allowed


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask: ContextParallelMask, scaling: float, window):
        groups = query.shape[1] // key.shape[1]
        q = query.float()
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([key, value])
        for step, allowed in _blocks(mask, window):
            pending = _start_exchange(kv, mask) if step + 1 < mask.size else None
            if allowed is not False:
                k, v = (_expand(t.float(), groups) for t in kv)
                out, lse = _merge(out, lse, *_block_forward(q, k, v, allowed, scaling))
            if pending is not None:
                kv = _finish(*pending)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mask, ctx.scaling, ctx.window, ctx.groups = mask, scaling, window, groups
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        mask, scaling, groups = ctx.mask, ctx.scaling, ctx.groups
        q, dout = query.float(), grad_out.float()
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax backward's correction
        lse = _finite(lse)[..., None]
        dq = torch.zeros_like(q)
        kv = torch.stack([key, value])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # travels with its block
        for step, allowed in _blocks(mask, ctx.window):
            pending = _start_exchange(kv, mask) if step + 1 < mask.size else None
            if allowed is not False:
                k, v = (_expand(t.float(), groups) for t in kv)
                probs = torch.exp(_scores(q, k, allowed, scaling) - lse)
                dv = torch.matmul(probs.transpose(-1, -2), dout)
                dscores = probs * (torch.matmul(dout, v.transpose(-1, -2)) - delta) * scaling
                dq += torch.matmul(dscores, k)
                dk = torch.matmul(dscores.transpose(-1, -2), q)
                dkv += torch.stack([_fold(dk, groups), _fold(dv, groups)])
            if pending is not None:
                kv = _finish(*pending)
            if mask.size > 1:  # the gradients follow their block; after the last step this hop brings them home
                dkv = _finish(*_start_exchange(dkv, mask))
        return dq.to(query.dtype), dkv[0].to(key.dtype), dkv[1].to(value.dtype), None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: ContextParallelMask, *,
                   scaling: float, window: int | None = None) -> torch.Tensor:
    """Attention of this rank's ``query [b, n, s, d]`` over the keys/values of every rank of the cp group
    (``key, value [b, n_kv, s, d]``, ``n`` a multiple of ``n_kv``); returns ``[b, n, s, d]``.

    Forward: ``cp - 1`` ring hops of the key/value blocks. Backward: ``cp - 1`` hops of key/value and ``cp`` hops of
    their fp32 gradients. See the module docstring."""
    return _RingAttention.apply(query, key, value, mask, scaling, window)
