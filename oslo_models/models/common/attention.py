"""Multi-head attention over this rank's heads, through ``transformers``' attention interface.

Families keep their own projection modules (BERT's ``query/key/value``, T5's ``q/k/v/o``: the names are the
state-dict contract) and call these helpers between the projections. Under tensor parallelism the q/k/v
projections are column-parallel, so their outputs hold ``n/tp`` whole heads and attention runs on those heads
with no communication; the output projection is row-parallel and does the reduction.

Shapes: b batch, s sequence (always the full sequence here: column-parallel layers gather it under sequence
parallelism), n heads (n/tp on this rank), d head dim.
"""
from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[b, s, (n/tp)*d]`` -> ``[b, n/tp, s, d]``."""
    return x.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)


def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, *, dropout,
           scaling: float, eager_fallback, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``query [b, n/tp, s_q, d]`` over ``key, value [b, n/tp, s_k, d]``; returns
    ``([b, s_q, (n/tp)*d], weights)``.

    ``module.config._attn_implementation`` picks the kernel (SDPA by default, ``eager_fallback`` for "eager").
    ``dropout`` is the attention-probability dropout module: under TP it draws from the tensor-parallel RNG
    stream, because each rank drops elements of different heads. Extra ``kwargs`` (e.g. T5's ``position_bias``)
    go to the kernel.
    """
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_fallback)
    with dropout.rng_context():
        out, weights = interface(module, query, key, value, attention_mask,
                                 dropout=dropout.p if module.training else 0.0, scaling=scaling, **kwargs)
    return out.reshape(*out.shape[:-2], -1).contiguous(), weights
