"""The one context-parallel attention core every family's attention layer calls when it is handed a
``ContextParallelMask`` (GPT-2, BERT/RoBERTa and the Llama family through ``models/common/attention/attention.py``).

``attention_function(module, attention_mask, eager_fallback)`` picks the kernel: the context-parallel one for a
``ContextParallelMask``, the packed-document FlexAttention core for a ``DocumentMask``
(``parallel_layers/document_attention.py``), else ``transformers``' attention interface named by
``config._attn_implementation``. The context-parallel kernel has the interface's signature and return layout
(``[b, s, n, d]``, no weights).
"""
from __future__ import annotations

import torch

from ..document_attention import DocumentMask, document_attention, flex_available
from .all_to_all import all_to_all_attention
from .chunking import ALL_TO_ALL, RING
from .dropout import AttentionDropout
from .hybrid import hybrid_attention
from .mask import ContextParallelMask
from .ring import FLEX, TILES, ring_attention


def choose_impl(implementation: str | None, device: torch.device, dropout: float = 0.0) -> str:
    """The per-block kernel of the context-parallel cores: ``"flex"`` (FlexAttention blocks, ``flex_blocks.py``)
    when asked for (``attn_implementation="flex_attention"``); else ``"tiles"`` (the fp32 masked tiles, torch's
    flash kernel for purely causal pairs), the default on every device for now: on CPU Flex is uncompiled (no
    log-sum-exp from the compiled CPU kernel) and has no backward, and its compiled CUDA kernel and backward have not
    run on a GPU here yet, so it is not made the default before they have (docs/context-parallel.md). The tiles are
    the only one for ``"eager"`` (its dead-row convention) and with dropout. Flex asked for with dropout, or on a
    torch without Flex, is a ``ValueError``. ``device`` is kept for the per-device default once it differs."""
    if implementation == "flex_attention":
        if not flex_available():
            raise ValueError("attn_implementation='flex_attention' under context parallelism needs FlexAttention "
                             "block masks (torch >= 2.5)")
        if dropout:
            raise ValueError("FlexAttention has no attention-probability dropout: under context parallelism use "
                             "attn_implementation='sdpa' or 'eager', or turn the attention dropout off")
        return FLEX
    return TILES


def context_parallel_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: ContextParallelMask, dropout: float = 0.0, scaling: float | None = None,
                               sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """``query [b, n, s_local, d]``, ``key [b, n_kv, s_local, d]``, ``value [b, n_kv, s_local, d_v]`` (``d_v != d``:
    multi-head latent attention) -> ``([b, s_local, n, d_v], None)``: attention over the whole sequence of the cp
    group, by ring, all-to-all or both (hybrid) as the mask says. ``dropout``: the attention-probability dropout,
    with keep bits that follow the global coordinates (``dropout.py``; one seed drawn per call from the current
    generator);
    ``softcap`` (Gemma 2) caps the scores inside each block; ALiBi rides on the mask (``mask.alibi``, Bloom /
    Falcon); ``s_aux [n]`` (gpt-oss's sinks) joins every row's denominator once; a query that sees no key follows
    the module's kernel (eager: the mean of all values, zeros with sinks; else zeros). Additive position biases (T5)
    go through ``gathered.py`` instead. The per-block kernel: :func:`choose_impl` of the module's
    ``attn_implementation``."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("an additive position bias (T5) in the ring / all-to-all core is not implemented: "
                                  "such a layer runs context_parallel/gathered.py's gathered_attention instead")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    core = {RING: ring_attention, ALL_TO_ALL: all_to_all_attention}.get(attention_mask.mode, hybrid_attention)
    sinks = kwargs.get("s_aux")  # gpt-oss's learned sinks [n] of this rank's heads
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    out = core(query, key, value, attention_mask, scaling=scaling, window=sliding_window,
               dropout=AttentionDropout.draw(dropout, query.device), softcap=kwargs.get("softcap"),
               uniform_dead_rows=implementation == "eager" and sinks is None, sinks=sinks,
               impl=choose_impl(implementation, query.device, dropout))
    return out.transpose(1, 2).contiguous(), None


def attention_function(module, attention_mask, eager_fallback):
    """The attention kernel for this call: context-parallel for a ``ContextParallelMask``, else ``transformers``'
    interface for ``module.config._attn_implementation`` (``eager_fallback`` for "eager")."""
    if isinstance(attention_mask, ContextParallelMask):
        return context_parallel_attention
    if isinstance(attention_mask, DocumentMask):  # packed documents on FlexAttention
        return document_attention
    # imported here: the data collators import this package, and om.data must not pull in transformers' model code
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_fallback)
