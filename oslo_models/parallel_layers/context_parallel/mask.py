"""``ContextParallelMask``: what an attention layer needs to attend across the chunks of a context-parallel group.

The model builds one per forward (``build_context_parallel_mask``) in place of the ``[b, 1, s, s]`` mask of a
single process, and the attention layers hand it on as their ``attention_mask``; seeing it, they run the
context-parallel core (``attention.py``) instead of their local kernel. It holds:

- ``token_index [cp, s_local]``: the global position of every token of every rank (``chunking.token_index``), so
  the causal (and sliding-window) mask between any query block and any key block is exact under any layout;
- ``key_valid [cp, b, s_local]`` (bool) or ``None``: the 2D padding mask of every rank, gathered once per forward
  (one small all-gather) so that the ring never has to pass it along with key/value blocks;
- ``document [cp, b, s_local]`` or ``None``: for packed samples (``position_ids`` that restart at document
  boundaries, with or without a padding mask) the document of every token, found on the whole sequence by the rule
  of the layouts without cp (``utils.documents.document_ids``); tokens attend within their document only;
- ``alibi`` (an ``AlibiBias``) or ``None``: the ALiBi slopes of this rank's heads and the position of every key of
  every rank, counted as ``transformers``' ALiBi decoders count them on the *whole* row (over the unmasked keys,
  restarting per packed document), so each tile of the ring / all-to-all adds exactly the single-process bias.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .chunking import HYBRID, MIRRORED, merge_sequence, split_sequence, token_index


@dataclass(frozen=True, eq=False)
class AlibiBias:
    """ALiBi under context parallelism. ``slopes [n_local]`` (this tensor-parallel rank's heads, in the dtype whose
    product the family rounds to: Falcon's bfloat16), ``divisor`` (Falcon: ``sqrt(head_dim)``; Bloom: 1),
    ``positions [cp, b, s_local]`` (long): each key's position over the unmasked keys of its whole row / document,
    per cp rank. The bias of key ``k`` for head ``h`` is ``slopes[h] * positions[k] / divisor`` for every query:
    ``transformers``' ``build_alibi_tensor`` values; it differs from ``slope * (k_global - q_global)`` by a
    constant per query row (the query's own position, and the padding before it), which softmax ignores."""

    slopes: torch.Tensor
    divisor: float
    positions: torch.Tensor

    def key_bias(self, positions: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor:
        """``[b, n, 1, s_k]`` fp32 bias of the keys at ``positions [b, s_k]`` for the heads ``heads`` of
        ``slopes``."""
        bias = (self.slopes[heads].to(positions.device)[None, :, None, None] * positions[:, None, None, :]).float()
        return bias / self.divisor if self.divisor != 1.0 else bias


@dataclass(frozen=True, eq=False)
class HybridGroups:
    """``context_parallel_mode="hybrid"``: the all-to-all group (``inner_size`` consecutive cp ranks) and the ring
    across the groups (``outer_ranks``: global ranks, in ring order, of this rank's position in every group)."""

    inner_group: dist.ProcessGroup
    inner_size: int
    outer_group: dist.ProcessGroup
    outer_ranks: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class ContextParallelMask:
    """See the module docstring. ``ranks``: global ranks of the cp group in cp-rank order (ring neighbours)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    ranks: tuple[int, ...]
    mode: str
    causal: bool
    token_index: torch.Tensor
    key_valid: torch.Tensor | None
    document: torch.Tensor | None = None
    alibi: AlibiBias | None = None
    hybrid: HybridGroups | None = None

    def ring_view(self, heads: slice) -> "ContextParallelMask":
        """Hybrid mode, after the all-to-all inside the group: the mask of the ring across the groups, each group's
        tokens (its members' chunks, in member order) one ring block, ALiBi slopes of this rank's ``heads``."""
        inner, size = self.hybrid.inner_size, self.size // self.hybrid.inner_size

        def grouped(t):  # [cp, b, s] -> [cp / inner, b, inner * s]
            if t is None:
                return None
            return t.view(size, inner, *t.shape[1:]).movedim(1, -2).reshape(size, *t.shape[1:-1], -1)

        alibi = None if self.alibi is None else AlibiBias(self.alibi.slopes[heads], self.alibi.divisor,
                                                          grouped(self.alibi.positions))
        return replace(self, group=self.hybrid.outer_group, size=size, rank=self.rank // inner,
                       ranks=self.hybrid.outer_ranks, token_index=self.token_index.reshape(size, -1),
                       key_valid=grouped(self.key_valid), document=grouped(self.document), alibi=alibi, hybrid=None)

    def gathered_view(self, heads: slice) -> "ContextParallelMask":
        """All-to-all mode, after the all-to-all: the whole gathered sequence as one block of a cp group of one
        (positions, padding, documents and ALiBi positions ``[1, b, s]``, this rank's ``heads``' slopes), so the
        ring's per-block kernels (``ring_attention`` with ``impl="flex"``) run the local attention."""
        def whole(t):  # [cp, b, s_local] -> [1, b, cp * s_local], the gathered order (cp-rank order)
            return None if t is None else t.permute(1, 0, 2).reshape(1, t.shape[1], -1)

        alibi = None if self.alibi is None else AlibiBias(self.alibi.slopes[heads], self.alibi.divisor,
                                                          whole(self.alibi.positions))
        return replace(self, size=1, rank=0, ranks=(self.ranks[self.rank],),
                       token_index=self.token_index.reshape(1, -1), key_valid=whole(self.key_valid),
                       document=whole(self.document), alibi=alibi, hybrid=None)

    def keys_of(self, rank: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(positions [s], valid [b, s] or None, document [b, s] or None)`` of the tokens of cp rank ``rank``."""
        pick = (lambda t: None if t is None else t[rank])
        return self.token_index[rank], pick(self.key_valid), pick(self.document)

    def allowed(self, q_index: torch.Tensor, k_index: torch.Tensor, k_valid: torch.Tensor | None,
                window: int | None = None, q_document=None, k_document=None) -> torch.Tensor | None:
        """Which keys each query may see: bool ``[b or 1, 1, s_q, s_k]``, or ``None`` when all of them.

        Causal: key position <= query position; sliding window ``w`` (``transformers``' rule): key position >
        query position - ``w``, and for a bidirectional mask (ModernBERT's local layers, which pass their half
        window + 1) also key position < query position + ``w``; padding: ``k_valid [b, s_k]``; packed documents:
        ``q_document [b, s_q]`` equal to ``k_document [b, s_k]``."""
        allowed = None
        if self.causal:
            allowed = k_index[None, :] <= q_index[:, None]
            if window is not None:
                allowed = allowed & (k_index[None, :] > q_index[:, None] - window)
            allowed = allowed[None, None]
        elif window is not None:
            allowed = ((k_index[None, :] - q_index[:, None]).abs() < window)[None, None]
        if k_valid is not None:
            valid = k_valid[:, None, None, :]
            allowed = valid if allowed is None else allowed & valid
        if k_document is not None:
            same = q_document[:, None, :, None] == k_document[:, None, None, :]
            allowed = same if allowed is None else allowed & same
        return allowed


def _gather(tensor: torch.Tensor, context) -> torch.Tensor:
    """``[cp, *tensor.shape]``: every cp rank's ``tensor`` (all-gather)."""
    gathered = [torch.empty_like(tensor) for _ in range(context.cp_size)]
    dist.all_gather(gathered, tensor.contiguous(), group=context.cp_group)
    return torch.stack(gathered)


def _documents(position_ids: torch.Tensor, key_valid: torch.Tensor, context, batch: int) -> torch.Tensor | None:
    """``[cp, b, s_local]`` document ids of packed samples, or ``None`` when the real tokens of every row are one
    document (one all-gather). ``key_valid [cp, b, s_local]``: the gathered padding mask; the rule is the one the
    layouts without cp follow (``utils.documents.document_ids``: each padding token a document of its own, left
    padding not packing), so a packed batch with a padding mask gives the same numbers at every cp size."""
    from ...utils.documents import document_ids

    parts = _gather(position_ids.expand(batch, -1).to(torch.long), context)
    mode, size = context.config.context_parallel_mode, context.cp_size
    full = merge_sequence(list(parts), mode)  # [b, s]: the global order
    valid = merge_sequence(list(key_valid), mode)
    document = document_ids(batch, full.shape[1], position_ids=full, attention_mask=valid)
    if document is None:
        return None
    return torch.stack([split_sequence(document, r, size, mode) for r in range(size)])


def with_alibi(mask: ContextParallelMask, slopes: torch.Tensor, divisor: float, batch: int) -> ContextParallelMask:
    """``mask`` (of a ``batch``-row forward) with an ``AlibiBias`` of this rank's head ``slopes [n_local]``: the key
    positions follow
    ``transformers``' ALiBi decoders on the whole row (``(cumsum(valid) - 1) * valid``, or within each packed
    document), computed from what the mask already gathered (no collective)."""
    size = mask.size
    shape = (size, batch, mask.token_index.shape[1])
    valid = (torch.ones(shape, dtype=torch.long, device=mask.token_index.device) if mask.key_valid is None
             else mask.key_valid.long())
    whole = merge_sequence(list(valid), mask.mode)  # [b, S] in global order
    if mask.document is not None:
        from ...utils.documents import positions_in_documents

        positions = positions_in_documents(merge_sequence(list(mask.document), mask.mode)) * whole
    else:
        positions = (whole.cumsum(-1) - 1) * whole
    per_rank = torch.stack([split_sequence(positions, r, size, mask.mode) for r in range(size)])
    return replace(mask, alibi=AlibiBias(slopes=slopes, divisor=float(divisor), positions=per_rank))


def build_context_parallel_mask(context, attention_mask: torch.Tensor | None, inputs_embeds: torch.Tensor, *,
                                causal: bool, position_ids: torch.Tensor | None = None) -> ContextParallelMask:
    """The mask of this forward: ``attention_mask`` is this rank's chunk(s) of the HF 2D padding mask ``[b,
    s_local]`` (1 = token, 0 = padding) or ``None``; ``inputs_embeds`` (or ids) is read for ``[b, s_local]`` and
    the device. ``position_ids`` (this rank's chunk, given by the caller) mark packed documents, with or without a
    padding mask. Collectives: one all-gather of the padding mask over cp (always, so every rank takes the same path
    whatever its own chunk holds), one of ``position_ids`` when given."""
    batch, seq_local = inputs_embeds.shape[:2]
    mode, size, rank = context.config.context_parallel_mode, context.cp_size, context.cp_rank
    if mode in MIRRORED and seq_local % 2:
        raise ValueError(f"context_parallel_mode={mode!r} holds two mirrored chunks per rank: the local sequence "
                         f"length must be even (the full length divisible by {2 * size}), got {seq_local}")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"context parallelism takes a 2D padding attention_mask [batch, seq_local], got shape "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, seq_local):
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match this rank's chunk "
                         f"{(batch, seq_local)}: split it with the context-parallel splitter like input_ids")
    device = inputs_embeds.device
    valid = (torch.ones(batch, seq_local, dtype=torch.uint8, device=device) if attention_mask is None
             else attention_mask.to(device=device, dtype=torch.uint8))
    key_valid = _gather(valid, context).bool()
    document = None
    if position_ids is not None:
        document = _documents(position_ids.to(device), key_valid, context, batch)
    index = torch.stack([token_index(seq_local, r, size, mode, device=device) for r in range(size)])
    hybrid = None
    if mode == HYBRID:
        inner, outer = context.axis("cp_a2a"), context.axis("cp_ring")
        hybrid = HybridGroups(inner.group, inner.size, outer.group, outer.ranks)
    return ContextParallelMask(group=context.cp_group, size=size, rank=rank, ranks=context.axis("cp").ranks,
                               mode=mode, causal=causal, token_index=index,
                               key_valid=None if bool(key_valid.all()) else key_valid, document=document,
                               hybrid=hybrid)
