"""All-to-all (Ulysses) context parallelism: trade the sequence split for a head split around the attention core.

Before attention each rank holds ``q, k, v [b, n, s/cp, d]`` (all of this tensor-parallel rank's heads, its chunk
of the sequence); one all-to-all per tensor turns them into ``[b, n/cp, s, d]`` (``n/cp`` heads, the whole
sequence), local attention runs on those, and one all-to-all turns the output back into ``[b, n, s/cp, d]``.
The backward of each all-to-all is the opposite all-to-all.

Communication per layer and rank (``e`` bytes per element): forward ``(cp-1)/cp * b*s/cp*d*e * (n + 2*n_kv + n)``
(q, k, v in, output back); backward the same. Needs ``n`` (heads on this tensor-parallel rank) divisible by ``cp``;
key/value heads that do not split are repeated to ``n`` first.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .dropout import AttentionDropout
from .mask import ContextParallelMask
from .ring import FLEX, TILES, _expand, check_impl, ring_attention


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack([piece.contiguous() for piece in x.chunk(size, dim=scatter_dim)])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Forward: split ``scatter_dim`` over the group, concatenate what arrives along ``gather_dim`` (in rank
    order). Backward: the opposite all-to-all."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, n, s/cp, d]`` -> ``[b, n/cp, s, d]`` (the sequence in cp-rank order)."""
    return _AllToAll.apply(x, 1, 2, group)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, n/cp, s, d]`` -> ``[b, n, s/cp, d]``."""
    return _AllToAll.apply(x, 2, 1, group)


def all_to_all_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: ContextParallelMask, *,
                         scaling: float, window: int | None = None, dropout: AttentionDropout | None = None,
                         softcap: float | None = None, uniform_dead_rows: bool = False,
                         sinks: torch.Tensor | None = None, impl: str = TILES) -> torch.Tensor:
    """Attention of ``query [b, n, s/cp, d]`` over ``key [b, n_kv, s/cp, d]``, ``value [b, n_kv, s/cp, d_v]`` of the
    whole cp group; returns ``[b, n, s/cp, d_v]``. Collectives: forward 4 all-to-alls (q, k, v, output), backward 4.
    ``dropout``: attention-probability dropout with the keep bits of ``dropout.py`` (this rank's heads are
    ``cp_rank * n/cp ..`` of the tensor-parallel rank's, as the ring numbers them), on explicit ``[b, n/cp, s, s]``
    probabilities; ``softcap`` (Gemma 2's ``c * tanh(scores / c)`` before the mask), ALiBi (``mask.alibi``: each
    key's bias from its position on the whole row, this rank's heads' slopes) and ``sinks [n]`` (gpt-oss: one extra
    softmax column per head, dropped after it; this rank's ``n/cp`` of them) on the same explicit scores. A query
    that sees no key gets zeros, or with ``uniform_dead_rows`` the mean of all values (``ring.py``). ``impl="flex"``:
    the local attention through the ring's FlexAttention blocks over the gathered sequence
    (``ContextParallelMask.gathered_view``: one block, its block mask from the summaries, no ``[s, s]`` mask)."""
    check_impl(impl, dropout)
    size, heads = mask.size, query.shape[1]
    if heads % size:
        raise ValueError(f"context_parallel_mode='all_to_all' needs the attention heads on each tensor-parallel "
                         f"rank ({heads}) divisible by context_parallel_size={size}; use 'ring'")
    if key.shape[1] % size:  # too few key/value heads to split: give every query head its own copy
        key, value = (_expand(t, heads // key.shape[1]) for t in (key, value))
    q, k, v = (sequence_to_heads(t, mask.group) for t in (query, key, value))
    if impl == FLEX:
        mine = slice(mask.rank * q.shape[1], (mask.rank + 1) * q.shape[1])  # this rank's heads of the tp rank's
        out = ring_attention(q, k, v, mask.gathered_view(mine), scaling=scaling, window=window, softcap=softcap,
                             uniform_dead_rows=uniform_dead_rows, sinks=None if sinks is None else sinks[mine],
                             impl=FLEX)
        return heads_to_sequence(out, mask.group)
    index = mask.token_index.reshape(-1)  # global position of each gathered token
    k, v = (_expand(t, q.shape[1] // t.shape[1]) for t in (k, v))
    valid, document = ((None if t is None else t.permute(1, 0, 2).reshape(q.shape[0], -1))  # [b, s]
                       for t in (mask.key_valid, mask.document))
    plain = mask.causal and window is None and valid is None and document is None  # no query sees no key
    heads = slice(mask.rank * q.shape[1], (mask.rank + 1) * q.shape[1])  # this rank's heads of the tp rank's
    alibi = None
    if mask.alibi is not None:  # [b, n/cp, 1, s]: the gathered keys' bias
        alibi = mask.alibi.key_bias(mask.alibi.positions.permute(1, 0, 2).reshape(q.shape[0], -1), heads)
    explicit = dropout is not None or softcap is not None or alibi is not None or sinks is not None
    allowed = None if plain and not explicit else mask.allowed(index, index, valid, window, document, document)
    dead = not plain and uniform_dead_rows and allowed is not None and not bool(allowed.any(-1).all())
    if explicit or dead:
        scores = (torch.matmul(q, k.transpose(-1, -2)) * scaling).float()
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if alibi is not None:
            scores = scores + alibi
        if allowed is not None:  # a finite fill, then zeros: a row that sees no key gets zeros (as the ring), no NaN
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if sinks is not None:  # one more column per head, dropped after the softmax
            sink = sinks[heads].float()[None, :, None, None].expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        if allowed is not None:  # uniform_dead_rows: a row that sees no key keeps its uniform softmax (eager's)
            probs = probs.masked_fill(~allowed & allowed.any(-1, keepdim=True) if uniform_dead_rows else ~allowed, 0.0)
        if dropout is not None:
            ids = mask.rank * q.shape[1] + torch.arange(q.shape[1], device=q.device)
            probs = probs * dropout.keep_scale(q.shape[0], ids, index, index)
        out = torch.matmul(probs.to(v.dtype), v)
    elif plain:  # the gathered tokens are in global order: plain causal attention, no s x s mask (flash kernels)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
    return heads_to_sequence(out, mask.group)
