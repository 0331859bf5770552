"""Context-parallel attention with an additive bias over (query, key) pairs (T5's relative position bias): the keys
and values of every cp rank are gathered, and each rank attends its own queries to the whole sequence.

The ring / all-to-all cores (``ring.py``, ``all_to_all.py``) merge softmax blocks whose scores they compute
themselves; a learned bias that depends on the pair of positions (T5: ``bias[h, bucket(k - q)]``) would need its
gradient formed inside every block. Here the bias is an ordinary tensor ``[1, n, s_local, s]`` (this rank's query
rows against every key, built by the layer from global positions: ``ContextParallelMask.token_index``), so autograd
gives its gradient; what is gathered is ``[b, n, s, d]`` keys and values, as Llama 3's context parallelism does.

Collectives per call: one all-gather of keys and one of values over cp (``cross.gather_summing_gradients``: backward one
all-reduce of each gradient over cp, this rank's chunk(s) kept, since every rank's queries read every key). Memory:
``[b, n, s_local, s]`` scores on each rank (``1/cp`` of the single-process ``[b, n, s, s]``).
"""
from __future__ import annotations

import torch

from .chunking import merge_sequence
from .cross import gather_summing_gradients
from .mask import ContextParallelMask


def gathered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: ContextParallelMask, *,
                       bias: torch.Tensor | None = None, scaling: float = 1.0, dropout=None) -> torch.Tensor:
    """``query [b, n, s_local, d]``, ``key / value [b, n, s_local, d]`` of this rank's tokens, ``bias`` (``[1 or b,
    n, s_local, s]``, added to the scores, any dtype) -> ``[b, s_local, n, d]``: softmax in fp32 of ``scaling * q k^T +
    bias`` over the keys ``mask`` allows (causal, padding, documents; a masked key gets the dtype's minimum, as
    ``transformers``' eager T5), ``dropout`` (a module, or ``None``) on the probabilities. ``hybrid`` masks are not
    taken (``ValueError``)."""
    if mask.hybrid is not None:
        raise ValueError("the gathered-keys core takes context_parallel_mode 'ring' or 'all_to_all', not 'hybrid'")
    keys = gather_summing_gradients(key, mask.group, mask.rank, mask.size, mask.mode, dim=2)  # [b, n, s, d] in order
    values = gather_summing_gradients(value, mask.group, mask.rank, mask.size, mask.mode, dim=2)
    q_index = mask.token_index[mask.rank]
    k_index = torch.arange(keys.shape[2], device=query.device)
    k_valid = None if mask.key_valid is None else merge_sequence(list(mask.key_valid), mask.mode, dim=1)
    q_doc = k_doc = None
    if mask.document is not None:
        q_doc, k_doc = mask.document[mask.rank], merge_sequence(list(mask.document), mask.mode, dim=1)
    allowed = mask.allowed(q_index, k_index, k_valid, q_document=q_doc, k_document=k_doc)
    scores = torch.matmul(query, keys.transpose(-1, -2))
    if scaling != 1.0:
        scores = scores * scaling
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).type_as(scores)
    if dropout is not None:
        probs = dropout(probs)
    return torch.matmul(probs, values).transpose(1, 2).contiguous()
