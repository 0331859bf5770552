"""1D (Megatron) tensor-parallel layers, with optional sequence parallelism.

Each class replaces the plain layer of the same kind (``layers.py``): same parameter names, same weight layout,
only the split dimension is ``1/tp`` of the full size. They are built by ``from_plain(module, context, ...)``
(on the meta device while a model loads, so nothing is allocated twice) and called with the plain layer's
signature. ``group`` is the tensor-parallel group; ``None`` means one rank and no communication.

Activations: ``[batch, seq, hidden]``; in a sequence-parallel forward (the model's ``SequenceParallelRegion`` is
active, or a call passes ``sequence_parallel=True``) the tensors outside the TP regions are ``[batch, seq/tp,
hidden]`` (this rank's contiguous slice of the sequence).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .. import fused_ops
from .layers import Dropout, Embedding, LayerNorm, Linear, linear_forward
from .mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from .sequence_parallel import SequenceParallelAware
from .sharding import divide, padded_size, split_layout


def mask_vocab_padding(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Local logits ``[..., n]`` of vocabulary ids ``vocab_start ..``: the padded columns (ids >= ``vocab_size``)
    get ``-inf`` so they carry no probability mass and no gradient."""
    local = logits.shape[-1]
    num_real = max(0, min(local, vocab_size - vocab_start))
    if num_real == local:
        return logits
    pad = torch.zeros(local, dtype=torch.bool, device=logits.device)
    pad[num_real:] = True
    return logits.masked_fill(pad, float("-inf"))


def strip_padding_and_unpack(full: torch.Tensor, vocab_size: int | None, num_packed: int, parts: int) -> torch.Tensor:
    """Outputs all-gathered from ``parts`` ranks along the last dim -> the plain layout: padded vocabulary columns
    dropped, or packed blocks (q|k|v, each split over the ranks) put back in order."""
    if vocab_size is not None:
        # slice only real padding: a no-op slice would still return a view, which FSDP2 warns about for every
        # model output
        return full[..., :vocab_size] if full.shape[-1] != vocab_size else full
    if num_packed > 1 and parts > 1:  # the packed layout's own join of the ranks' pieces
        return split_layout(-1, num_packed=num_packed).join(list(full.chunk(parts, dim=-1)))
    return full


class ColumnParallelLinear(SequenceParallelAware, Linear):
    """``Y = X A + b`` with ``A`` split by output columns: rank ``r`` computes ``Y[..., r-th block]``.

    Input ``[b, s, in]`` replicated (or ``[b, s/tp, in]`` under sequence parallelism); output ``[b, s, out/tp]``.
    Forward collective: none (sequence parallel: all-gather along seq). Backward: all-reduce of the input
    gradient (sequence parallel: reduce-scatter along seq).

    ``num_packed`` > 1 means the output holds that many equal blocks (GPT-2's fused q|k|v); each block is split
    separately so rank ``r`` owns heads ``r*n/tp .. (r+1)*n/tp`` of q, of k and of v. ``vocab_size`` pads the
    output up to a multiple of ``tp`` (for LM heads) and masks the padded logits to ``-inf``.
    """

    def __init__(self, in_features: int, out_features: int, *, group, bias: bool = True, layout: str = "linear",
                 num_packed: int = 1, vocab_size: int | None = None, gather_output: bool = False,
                 device=None, dtype=None):
        self.group, self.tp_size, self.tp_rank = group, group_size(group), group_rank(group)
        self.full_out_features, self.num_packed, self.vocab_size = out_features, num_packed, vocab_size
        if vocab_size is not None:
            local = padded_size(out_features, self.tp_size) // self.tp_size
        else:
            block = divide(out_features, num_packed, "packed output size") if num_packed > 1 else out_features
            local = divide(block, self.tp_size, "output features") * num_packed
        super().__init__(in_features, local, bias=bias, layout=layout, device=device, dtype=dtype)
        self.gather_output = gather_output

    @classmethod
    def from_plain(cls, module: Linear | nn.Linear, group, **options) -> "ColumnParallelLinear":
        layout = getattr(module, "layout", "linear")
        return cls(module.in_features, module.out_features, group=group, bias=module.bias is not None,
                   layout=layout, device=module.weight.device, dtype=module.weight.dtype, **options)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None, skip_bias_add: bool = False):
        """``y``; with ``skip_bias_add=True`` (Megatron's option) ``(x A, b)``: this rank's unbiased output
        ``[b, s, out/tp]`` and bias ``[out/tp]`` (or ``None``), for a caller that fuses the add with what follows
        (``fused_ops.bias_gelu``). Not for a vocab or gathered output (``ValueError``)."""
        x = self.enter_tensor_parallel(x, sequence_parallel)
        if skip_bias_add:
            if self.vocab_size is not None or self.gather_output:
                raise ValueError("skip_bias_add=True is for a split hidden output, not an LM head or a gathered one")
            return linear_forward(x, self.weight, None, self.layout), self.bias
        y = linear_forward(x, self.weight, self.bias, self.layout)
        if self.vocab_size is not None and self.tp_size > 1:
            y = self.mask_vocab_padding(y)
        if self.gather_output:
            y = self.gather(y)
        return y

    forward.takes_skip_bias_add = True  # see models/common/feed_forward/bias_act.py

    def mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        return mask_vocab_padding(logits, self.tp_rank * self.out_features, self.vocab_size)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """Local output ``[..., out/tp]`` -> full ``[..., out]`` (padding stripped). Backward: split.
        At tp=1 with nothing to strip this is ``y`` itself, so a loss computed on ``y`` is a function of the
        returned logits (as in ``transformers``)."""
        if self.tp_size == 1 and (self.vocab_size is None or y.shape[-1] == self.vocab_size):
            return y
        full = gather_from_tensor_parallel_region(y, self.group, dim=-1)
        return strip_padding_and_unpack(full, self.vocab_size, self.num_packed, self.tp_size)

    @property
    def vocab_start_index(self) -> int:
        return self.tp_rank * self.out_features


class RowParallelLinear(SequenceParallelAware, Linear):
    """``Y = X A + b`` with ``A`` split by input rows: rank ``r`` holds ``X[..., r-th block]`` and ``A[r-th rows]``.

    Input ``[b, s, in/tp]`` (the output of a column-parallel layer); output ``[b, s, out]`` replicated, or
    ``[b, s/tp, out]`` under sequence parallelism. Forward collective: all-reduce of the partial products
    (sequence parallel: reduce-scatter along seq). Backward: none (sequence parallel: all-gather along seq).
    The bias is added once, after the reduction; under sequence parallelism its gradient is summed over ranks.
    """

    def __init__(self, in_features: int, out_features: int, *, group, bias: bool = True, layout: str = "linear",
                 device=None, dtype=None):
        self.group, self.tp_size = group, group_size(group)
        self.full_in_features = in_features
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features, bias=bias,
                         layout=layout, device=device, dtype=dtype)

    @classmethod
    def from_plain(cls, module: Linear | nn.Linear, group, **options) -> "RowParallelLinear":
        layout = getattr(module, "layout", "linear")
        return cls(module.in_features, module.out_features, group=group, bias=module.bias is not None,
                   layout=layout, device=module.weight.device, dtype=module.weight.dtype, **options)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        if self.tp_size == 1:
            return linear_forward(x, self.weight, self.bias, self.layout)
        y = linear_forward(x, self.weight, None, self.layout)
        if self.sequence_parallel_active(sequence_parallel):
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
            bias = copy_to_tensor_parallel_region(self.bias, self.group) if self.bias is not None else None
        else:
            y = reduce_from_tensor_parallel_region(y, self.group)
            bias = self.bias
        return y + bias if bias is not None else y


class VocabParallelEmbedding(Embedding):
    """Embedding table split by vocabulary rows; the vocabulary is padded up to a multiple of ``tp``.

    Input ``[b, s]`` ids (replicated); output ``[b, s, dim]``. Each rank looks up the ids it owns and writes zeros
    elsewhere. Forward: all-reduce of the partial lookups. Backward: none (each rank's rows get their own grads).
    The padded rows are zeros and are dropped when the model is saved.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group, padding_idx=None, device=None,
                 dtype=None):
        self.group, self.tp_size, self.tp_rank = group, group_size(group), group_rank(group)
        self.vocab_size = num_embeddings
        local = padded_size(num_embeddings, self.tp_size) // self.tp_size
        self.vocab_start_index = self.tp_rank * local
        super().__init__(local, embedding_dim, device=device, dtype=dtype)
        self.padding_idx_full = padding_idx
        # As nn.Embedding(padding_idx=...): the padding row gets no gradient. Only the rank owning it has it.
        owned = padding_idx is not None and 0 <= padding_idx - self.vocab_start_index < local
        self.local_padding_idx = padding_idx - self.vocab_start_index if owned else None

    @classmethod
    def from_plain(cls, module: nn.Embedding, group, **options) -> "VocabParallelEmbedding":
        return cls(module.num_embeddings, module.embedding_dim, group=group, padding_idx=module.padding_idx,
                   device=module.weight.device, dtype=module.weight.dtype, **options)

    def forward(self, ids: torch.Tensor, *, sequence_parallel: bool = False) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight, padding_idx=self.local_padding_idx)
        local_ids = ids - self.vocab_start_index
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings)
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.group)


class SequenceParallelLayerNorm(SequenceParallelAware, LayerNorm):
    """LayerNorm whose replicated weight and bias see only this rank's tokens under sequence parallelism.

    ``always_reduce=True``: a norm inside the tensor-parallel region (Phi's ``q_layernorm``/``k_layernorm`` over
    ``head_dim``) sees only this rank's heads, with or without sequence parallelism.

    Forward: none. Backward: all-reduce of the weight and bias gradients over the TP group when the call was
    partial (each rank holds a partial sum over its slice of the sequence, or of the heads); none otherwise.
    """

    def __init__(self, normalized_shape, *, group, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, fused: bool = False, always_reduce: bool = False, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        self.group = group
        self.fused = fused  # the Triton kernel on CUDA (oslo_models.fused_ops.layer_norm); the torch op elsewhere
        self.always_reduce = always_reduce

    @classmethod
    def from_plain(cls, module: nn.LayerNorm, group, *, fused: bool = False,
                   always_reduce: bool = False) -> "SequenceParallelLayerNorm":
        weight = module.weight
        return cls(module.normalized_shape, group=group, eps=module.eps,
                   elementwise_affine=module.elementwise_affine, bias=module.bias is not None, fused=fused,
                   always_reduce=always_reduce, device=weight.device if weight is not None else None,
                   dtype=weight.dtype if weight is not None else None)

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.always_reduce or self.sequence_parallel_active(sequence_parallel):
            weight = copy_to_tensor_parallel_region(weight, self.group) if weight is not None else None
            bias = copy_to_tensor_parallel_region(bias, self.group) if bias is not None else None
        if self.fused and weight is not None and len(self.normalized_shape) == 1:
            return fused_ops.layer_norm(x, weight, bias, self.eps, enabled=True)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class ParallelDropout(SequenceParallelAware, Dropout):
    """Dropout that draws from the tensor-parallel RNG stream when its activations differ across TP ranks.

    ``always_split=True``: activations inside a TP region (this rank's attention heads). Otherwise the stream is
    split only for sequence-parallel calls (this rank's slice of the tokens) and is the default one when the
    activations are replicated, so every TP rank drops the same elements.
    """

    def __init__(self, p: float, *, rng, always_split: bool = False):
        super().__init__(p)
        self.rng, self.always_split = rng, always_split

    @classmethod
    def from_plain(cls, module: nn.Dropout, group, *, rng, always_split: bool = False) -> "ParallelDropout":
        return cls(module.p, rng=rng, always_split=always_split)

    def rng_context(self, sequence_parallel: bool | None = None):
        # No draw, no fork: swapping generator states is opaque to torch.compile (a graph break in every
        # attention block), so evaluation and p=0 must not pay for it.
        if self.rng is None or not self.training or self.p == 0.0:
            return contextlib.nullcontext()
        return self.rng.fork(enabled=self.always_split or self.sequence_parallel_active(sequence_parallel))

    def forward(self, x: torch.Tensor, *, sequence_parallel: bool | None = None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.rng_context(sequence_parallel):
            return F.dropout(x, self.p, True)

