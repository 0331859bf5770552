"""Ring attention: each rank keeps its queries and passes key/value blocks around the context-parallel ring.

Forward, on rank ``r`` of ``cp``, step ``j = 0 .. cp-1`` (``src = r - j``): send the key/value block it holds to
``r + 1`` and receive the next from ``r - 1`` (``batch_isend_irecv``, started before the block's compute so the
transfer overlaps it), attend its queries to block ``src`` and merge into the running output with the block's
log-sum-exp (online softmax, fp32). Blocks a causal mask hides completely are skipped. Within a block, when only
the causal structure masks (no padding, sliding window or packed documents), each (query chunk, key chunk) pair is
fully visible or plainly causal and runs through torch's CPU flash kernel (``_scaled_dot_product_flash_attention_
for_cpu``, which returns the log-sum-exp); otherwise (and on GPUs) the block runs as query tiles of masked scores,
so no ``s x s`` score or mask matrix ever exists. Logit soft-capping (Gemma 2: ``c * tanh(scores / c)`` before the
mask) acts on each tile's scores, which is all the cap needs: the merge by log-sum-exp is over capped scores.
ALiBi (Bloom, Falcon: the mask's ``AlibiBias``) adds each key's bias, from its position on the *whole* row, to the
tile's scores after the cap. Learned sinks (gpt-oss: one logit per head in every softmax's denominator) join once,
at the end of the forward: the merged output is renormalised, ``out * exp(lse - logaddexp(lse, sink))``, and the
saved log-sum-exp includes the sink, so the backward's probabilities are the sink-normalised ones and the sink's
gradient is ``-sum(P_sink * rowsum(dO * O))``. Keys and values may differ in head dim (multi-head latent attention:
``d_qk != d_v``): they travel as one ``[.., d_qk + d_v]`` block and the tiles compute with the split.

A query that sees no key at all (a padding token whose window holds only padding) gets zeros, as SDPA gives; with
``uniform_dead_rows`` (the family's kernel is eager, whose additive minimum-filled mask makes such a row's softmax
uniform over every key of the sequence) it gets the mean of all values instead, so such positions' outputs equal
``transformers``' there too (their loss weight is zero either way).

Backward (recompute, flash-attention style): the same ring again; per block the probabilities are rebuilt from the
saved log-sum-exp, ``dQ`` accumulates locally and ``dK``/``dV`` accumulators travel *with* their block, so after
``cp`` hops (one more than the key/value blocks make) every rank holds the full gradient of its own key/value.

FlexAttention blocks (``impl="flex"``, ``flex_blocks.py``): each (query rows, key/value block) pair of a step runs
``flex_attention`` with a ``BlockMask`` built from that pair's documents, causality, window and padding and a
``score_mod`` for the cap and ALiBi, returning its log-sum-exp; the merge, the sinks, the dead rows and the ring's
exchanges are the same. The backward on CUDA is autograd through the recomputed Flex block (``block_vjp``); on CPU,
where Flex has no backward, the tile recompute above from the saved log-sum-exp. ``attention.choose_impl`` picks.

Communication per layer and rank (``b`` batch, ``n_kv`` key/value heads on this rank, ``s`` local length, ``d``
head dim, ``e`` bytes per element): forward ``(cp-1) * 2*b*n_kv*s*d*e``; backward the same for key/value plus
``cp * 2*b*n_kv*s*d*4`` for the fp32 gradients. Arithmetic in fp32 whatever the input dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .chunking import RING, chunk_ids
from .dropout import AttentionDropout
from .flex_blocks import block_vjp, flex_with_lse, pair_block_mask, score_mod_for
from .mask import ContextParallelMask

TILES, FLEX = "tiles", "flex"  # the per-block kernels: fp32 masked tiles (the fallback), FlexAttention blocks


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


_TILE_ELEMENTS = 2 ** 24  # scores of at most this many elements (64 MiB in fp32) exist at once


def _row_tiles(num_rows: int, row_elements: int):
    """Slices of query rows such that one tile's scores ``[b, n, rows, s_k]`` stay under ``_TILE_ELEMENTS``: the
    block's full ``s x s`` scores (and mask) never exist, as in flash attention."""
    step = max(1, _TILE_ELEMENTS // max(1, row_elements))
    for start in range(0, num_rows, step):
        yield slice(start, min(num_rows, start + step))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows that see no key) replaced by 0, so ``exp(-inf - lse)`` is 0, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


class _Block:
    """One key/value block as seen from this rank's queries: positions, padding and documents of both sides."""

    def __init__(self, mask: ContextParallelMask, src: int, window, softcap=None):
        self.mask, self.window, self.src, self.softcap = mask, window, src, softcap
        self.q_index, _, self.q_document = mask.keys_of(mask.rank)
        self.k_index, self.k_valid, self.k_document = mask.keys_of(src)
        # ALiBi: [b, n, 1, s_k] bias of the block's keys (their positions on the whole row), or None
        self.alibi = None if mask.alibi is None else mask.alibi.key_bias(mask.alibi.positions[src])

    def chunk_pairs(self, q: torch.Tensor, v: torch.Tensor):
        """``[(query rows, key rows, causal)]`` covering exactly what the queries see, when only the causal
        structure masks (no padding, window or documents) and torch's CPU flash kernel can run each pair; else
        ``None``. A (query chunk, key chunk) pair is fully visible (earlier key chunk), causal (the same chunk) or
        hidden (a later one): the load-balanced layout cuts no chunk."""
        mask = self.mask
        if q.device.type != "cpu" or mask.mode != RING or self.window is not None or self.k_valid is not None or \
                self.k_document is not None or self.softcap is not None or self.alibi is not None or \
                v.shape[-1] != q.shape[-1]:  # the CPU flash kernel needs one head dim for q, k and v
            return None
        if not mask.causal:
            return [(slice(None), slice(None), False)]
        q_ids = chunk_ids(mask.rank, mask.size, mask.mode)
        k_ids = chunk_ids(self.src, mask.size, mask.mode)
        size = q.shape[2] // len(q_ids)
        rows = (lambda i: slice(i * size, (i + 1) * size))
        return [(rows(a), rows(b), qi == kj) for a, qi in enumerate(q_ids) for b, kj in enumerate(k_ids) if kj <= qi]

    @property
    def hidden(self) -> bool:
        """Whether no query sees any key of the block (skipped without computing a mask)."""
        causal_hidden = self.mask.causal and bool(self.k_index.min() > self.q_index.max())
        return causal_hidden or (self.k_valid is not None and not bool(self.k_valid.any()))

    def keep_scale(self, dropout: AttentionDropout | None, q: torch.Tensor, rows: slice):
        """The dropout factors ``[b, n, len(rows), s_k]`` of the query rows ``rows`` (``dropout.py``), or 1."""
        if dropout is None:
            return 1.0
        heads = torch.arange(q.shape[1], device=q.device)
        return dropout.keep_scale(q.shape[0], heads, self.q_index[rows], self.k_index, q.dtype)

    def scores(self, q_rows: torch.Tensor, rows: slice, k: torch.Tensor, scaling: float):
        """``(scores, slope)``: the masked (soft-capped) scores ``[b, n, len(rows), s_k]`` of the query rows
        ``rows``, and the cap's derivative ``1 - tanh^2`` there (``None`` without a cap), for the backward."""
        doc = None if self.q_document is None else self.q_document[:, rows]
        allowed = self.mask.allowed(self.q_index[rows], self.k_index, self.k_valid, self.window, doc, self.k_document)
        scores = torch.matmul(q_rows, k.transpose(-1, -2)) * scaling
        slope = None
        if self.softcap is not None:
            capped = torch.tanh(scores / self.softcap)
            scores, slope = capped * self.softcap, 1 - capped * capped
        if self.alibi is not None:  # additive: the backward needs no term of its own
            scores = scores + self.alibi
        return (scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))), slope

    def flex(self, rows: slice, scaling: float):
        """``run(q_rows, k, v) -> (out, lse)``: FlexAttention of the query rows ``rows`` over the block, with the
        pair's block mask (documents, causality, window, padding: ``flex_blocks.pair_block_mask``) and the cap /
        ALiBi as ``score_mod``; compiled on CUDA, the uncompiled kernel on CPU (``flex_blocks.py``)."""
        doc = None if self.q_document is None else self.q_document[:, rows]
        block_mask = pair_block_mask(self.q_index[rows], self.k_index, causal=self.mask.causal, window=self.window,
                                     q_document=doc, k_document=self.k_document, k_valid=self.k_valid)
        score_mod = score_mod_for(self.softcap, None if self.alibi is None else self.alibi[:, :, 0])

        def run(q, k, v):
            return flex_with_lse(q, k, v, block_mask=block_mask, score_mod=score_mod, scale=scaling,
                                 compiled=q.device.type != "cpu")

        return run


def _flex_tiles(q: torch.Tensor, k: torch.Tensor):
    """The query-row slices of the Flex path: the whole block in one compiled call on CUDA; on CPU (the uncompiled
    kernel materialises its scores) tiles of ``_TILE_ELEMENTS`` scores, as the fp32 tile path."""
    if q.device.type != "cpu":
        return [slice(0, q.shape[2])]
    return list(_row_tiles(q.shape[2], q.shape[0] * q.shape[1] * k.shape[2]))


def _flex_block_forward(block: _Block, q, k, v, scaling):
    """``(out, lse)`` of the queries ``q`` over one block through FlexAttention (``flex_blocks.py``)."""
    outs, lses = [], []
    q, k, v = q.detach(), k.detach(), v.detach()  # the ring's own backward: Flex is called without autograd here
    for rows in _flex_tiles(q, k):
        out, lse = block.flex(rows, scaling)(q[:, :, rows], k, v)
        outs.append(out.float())
        lses.append(lse.float())
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _flex_block_backward(block: _Block, q, k, v, dout, out, raw_lse, delta, dq, scaling):
    """CUDA: this block's ``(dk, dv)`` (and ``dq`` added in place) by autograd through the recomputed Flex block
    (``flex_blocks.block_vjp``; ``raw_lse`` the merged, sink-including log-sum-exp, ``delta [b, n, s, 1]``)."""
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rows in _flex_tiles(q, k):
        grads = block_vjp(block.flex(rows, scaling), q[:, :, rows], k, v, dout[:, :, rows], out[:, :, rows],
                          raw_lse[:, :, rows], delta[:, :, rows, 0])
        dq[:, :, rows] += grads[0]
        dk += grads[1]
        dv += grads[2]
    return dk, dv


def _block_forward(block: _Block, q, k, v, scaling, dropout=None):
    """``(out, lse)`` of the queries ``q`` over one block: chunk pairs through torch's CPU flash kernel where they
    cover the mask exactly, else tile by tile. ``dropout`` (an ``AttentionDropout``): the kept probabilities,
    scaled, times ``v`` (tiles only); ``lse`` is the undropped one, so the online merge stays exact."""
    pairs = None if dropout is not None else block.chunk_pairs(q, v)
    if pairs is not None:
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        for rows, cols, causal in pairs:
            pair = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, rows].contiguous(), k[:, :, cols].contiguous(), v[:, :, cols].contiguous(), 0.0, causal,
                scale=scaling)
            out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], *pair)
        return out, lse
    outs, lses = [], []
    for rows in _row_tiles(q.shape[2], q.shape[0] * q.shape[1] * k.shape[2]):
        scores, _ = block.scores(q[:, :, rows], rows, k, scaling)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(lse)[..., None])
        outs.append(torch.matmul(probs * block.keep_scale(dropout, q, rows), v))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block_backward(block: _Block, q, k, v, dout, out, raw_lse, delta, lse, dq, scaling, dropout=None):
    """Add this block's share to ``dq`` (in place); return its ``(dk, dv)``. ``out``/``raw_lse``: the final
    attention output and log-sum-exp (the flash backward's inputs); ``lse``/``delta`` ``[b, n, s, 1]``. With
    ``dropout`` the same keep bits as the forward: ``dV = (P*M)^T dO``, ``dS = P * ((dO V^T) * M - delta)`` (``M``
    the scaled keep mask; ``delta = rowsum(dO * O)`` holds with dropout too)."""
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    pairs = None if dropout is not None else block.chunk_pairs(q, v)
    if pairs is not None:
        for rows, cols, causal in pairs:
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[:, :, rows].contiguous(), q[:, :, rows].contiguous(), k[:, :, cols].contiguous(),
                v[:, :, cols].contiguous(), out[:, :, rows].contiguous(), raw_lse[:, :, rows].contiguous(), 0.0,
                causal, scale=scaling)
            dq[:, :, rows] += grads[0]
            dk[:, :, cols] += grads[1]
            dv[:, :, cols] += grads[2]
        return dk, dv
    for rows in _row_tiles(q.shape[2], q.shape[0] * q.shape[1] * k.shape[2]):
        scores, slope = block.scores(q[:, :, rows], rows, k, scaling)
        probs = torch.exp(scores - lse[:, :, rows])
        keep = block.keep_scale(dropout, q, rows)
        dv += torch.matmul((probs * keep).transpose(-1, -2), dout[:, :, rows])
        dprobs = torch.matmul(dout[:, :, rows], v.transpose(-1, -2)) * keep
        dscores = probs * (dprobs - delta[:, :, rows]) * scaling
        if slope is not None:  # through the cap: d(c tanh(x / c)) = (1 - tanh^2) dx
            dscores = dscores * slope
        dq[:, :, rows] += torch.matmul(dscores, k)
        dk += torch.matmul(dscores.transpose(-1, -2), q[:, :, rows])
    return dk, dv


def _merge(out, lse, block_out, block_lse):
    """Online-softmax merge of two partial attentions over disjoint key sets."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], new


def _split(kv: torch.Tensor, key_dim: int, groups: int):
    """``(k, v)`` fp32, expanded to the query heads, of a travelling ``[b, n_kv, s, d_k + d_v]`` block."""
    return (_expand(t.float(), groups) for t in (kv[..., :key_dim], kv[..., key_dim:]))


def _blocks(mask: ContextParallelMask, window, softcap=None):
    """``(step, block)`` for each ring step; the block of step ``j`` came from rank ``rank - j``."""
    for step in range(mask.size):
        yield step, _Block(mask, (mask.rank - step) % mask.size, window, softcap)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask: ContextParallelMask, scaling: float, window, dropout, softcap,
                uniform_dead_rows, sinks, impl):
        groups, key_dim = query.shape[1] // key.shape[1], key.shape[-1]
        q = query.float()
        out = torch.zeros(*q.shape[:-1], value.shape[-1], dtype=torch.float32, device=q.device)  # [b, n, s, d_v]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([key, value.to(key.dtype)], dim=-1)  # one block travels: [b, n_kv, s, d_k + d_v]
        value_sum = torch.zeros(*q.shape[:2], value.shape[-1], dtype=torch.float32, device=q.device)  # [b, n, d_v]
        for step, block in _blocks(mask, window, softcap):
            pending = _start_exchange(kv, mask) if step + 1 < mask.size else None
            if not block.hidden:
                k, v = _split(kv, key_dim, groups)
                part = _flex_block_forward(block, q, k, v, scaling) if impl == FLEX else \
                    _block_forward(block, q, k, v, scaling, dropout)
                out, lse = _merge(out, lse, *part)
            if uniform_dead_rows:
                value_sum += _expand(kv[..., key_dim:].float(), groups).sum(2)
            if pending is not None:
                kv = _finish(*pending)
        if uniform_dead_rows:  # rows that saw no key: the mean of every value (eager's uniform softmax)
            total = key.shape[2] * mask.size
            out = torch.where(torch.isinf(lse)[..., None], (value_sum / total)[:, :, None], out)
        if sinks is not None:  # once, after the merge: the sink's logit joins every row's denominator
            final = torch.logaddexp(lse, sinks.float()[None, :, None])
            out, lse = out * torch.exp(lse - final)[..., None], final
        ctx.uniform_dead_rows, ctx.has_sinks = uniform_dead_rows, sinks is not None
        ctx.save_for_backward(query, key, value, out, lse, sinks)
        ctx.mask, ctx.scaling, ctx.window, ctx.groups, ctx.dropout = mask, scaling, window, groups, dropout
        ctx.softcap, ctx.impl = softcap, impl
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, sinks = ctx.saved_tensors
        mask, scaling, groups, key_dim = ctx.mask, ctx.scaling, ctx.groups, key.shape[-1]
        q, dout = query.float(), grad_out.float()
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax backward's correction
        raw_lse, lse = lse, _finite(lse)[..., None]
        dq = torch.zeros_like(q)
        kv = torch.cat([key, value.to(key.dtype)], dim=-1)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # travels with its block
        dead_grad = None
        if ctx.uniform_dead_rows:  # each dead row's output is the mean of all values: dV gets dout / total
            dead = torch.isinf(raw_lse)[..., None]
            dead_grad = _fold((dout * dead).sum(2, keepdim=True) / (key.shape[2] * mask.size), groups)
        for step, block in _blocks(mask, ctx.window, ctx.softcap):
            pending = _start_exchange(kv, mask) if step + 1 < mask.size else None
            if not block.hidden:
                k, v = _split(kv, key_dim, groups)
                if ctx.impl == FLEX and q.device.type != "cpu":  # Flex's own backward (none on CPU: the tiles)
                    dk, dv = _flex_block_backward(block, q, k, v, dout, out, raw_lse, delta, dq, scaling)
                else:
                    dk, dv = _block_backward(block, q, k, v, dout, out, raw_lse, delta, lse, dq, scaling,
                                             ctx.dropout)
                dkv += torch.cat([_fold(dk, groups), _fold(dv, groups)], dim=-1)
            if dead_grad is not None:
                dkv[..., key_dim:] += dead_grad
            if pending is not None:
                kv = _finish(*pending)
            if mask.size > 1:  # the gradients follow their block; after the last step this hop brings them home
                dkv = _finish(*_start_exchange(dkv, mask))
        dsinks = None
        if ctx.has_sinks:  # the sink column: dS = P_sink * (0 - delta), summed over batch and queries
            dsinks = -(torch.exp(sinks.float()[None, :, None] - raw_lse) * delta[..., 0]).sum((0, 2)).to(sinks.dtype)
        return (dq.to(query.dtype), dkv[..., :key_dim].to(key.dtype), dkv[..., key_dim:].to(value.dtype), None, None,
                None, None, None, None, dsinks, None)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: ContextParallelMask, *,
                   scaling: float, window: int | None = None, dropout: AttentionDropout | None = None,
                   softcap: float | None = None, uniform_dead_rows: bool = False,
                   sinks: torch.Tensor | None = None, impl: str = TILES) -> torch.Tensor:
    """Attention of this rank's ``query [b, n, s, d]`` over the keys/values of every rank of the cp group
    (``key [b, n_kv, s, d]``, ``value [b, n_kv, s, d_v]``, ``n`` a multiple of ``n_kv``); returns ``[b, n, s, d_v]``.
    ``softcap``: logits soft-capped, ``c * tanh(scores / c)``, before the mask (Gemma 2); ALiBi comes with the mask
    (``mask.alibi``); ``sinks [n]``: one learned logit per head in every row's softmax denominator (gpt-oss; its
    gradient is returned); ``uniform_dead_rows``: a query that sees no key gets the mean of all values (the eager
    kernels' convention) instead of zeros (not with ``sinks``, whose eager kernel gives such a row zeros).

    Forward: ``cp - 1`` ring hops of the key/value blocks. Backward: ``cp - 1`` hops of key/value and ``cp`` hops of
    their fp32 gradients. ``dropout``: attention-probability dropout (``dropout.py``). ``impl``: ``"tiles"`` (fp32
    masked tiles, torch's CPU flash kernel where only causality masks) or ``"flex"`` (FlexAttention blocks,
    ``flex_blocks.py``; no dropout). See the module docstring."""
    if sinks is not None and uniform_dead_rows:
        raise ValueError("sinks give a row that sees no key zeros: uniform_dead_rows does not apply")
    check_impl(impl, dropout)
    return _RingAttention.apply(query, key, value, mask, scaling, window, dropout, softcap, uniform_dead_rows, sinks,
                                impl)


def check_impl(impl: str, dropout) -> None:
    """``ValueError`` for an unknown ``impl`` or Flex with attention-probability dropout (Flex has none)."""
    if impl not in (TILES, FLEX):
        raise ValueError(f"context-parallel attention impl={impl!r} is unknown; choose {TILES!r} or {FLEX!r}")
    if impl == FLEX and dropout is not None:
        raise ValueError("FlexAttention has no attention-probability dropout: under context parallelism use "
                         "attn_implementation='sdpa' or 'eager' (the fp32 tile cores), or turn the dropout off")
