"""The global gradient norm of a model whose parameters state their layout by DTensor placements (the model protocol's
``layout == "placements"``: ``transformers``' classes on the generic path), from where each gradient element lives.

Such a model has no plan: its gradients say how they are laid out. A DTensor gradient (tensor
parallel over ``tp``, FSDP2 over ``dp``, or both) is split along the mesh dimensions where its placement is
``Shard`` (or ``_StridedShard``) and held whole along the others; a plain tensor is held whole by every rank (DDP /
ZeRO-1 replicas, and the parameters a tensor-parallel plan leaves alone, whose gradients are equal on all tp ranks).
Every element of the full gradient therefore lives on ``world / pp / (product of its sharded mesh sizes)`` ranks (the
ranks of its pipeline stage; a tied copy on a later stage is skipped, ``pipeline.stage.tied_duplicates``). Each rank
adds up ``|g|^p`` over its local elements divided by that count, and one all-reduce (sum) over the world gives the
total; for ``p = inf`` it takes the maximum (copies do not matter). ``Partial`` gradients (a sum still pending) are
reduced to ``Replicate`` first.

Collectives: one all-reduce of one number over the world (plus the redistribution of any ``Partial`` gradient).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


def _holders(grad: torch.Tensor, world_size: int) -> int:
    """How many ranks hold each element of ``grad``."""
    if not hasattr(grad, "placements"):
        return world_size
    from torch.distributed.tensor.placement_types import _StridedShard

    sharded = 1
    for dim, placement in enumerate(grad.placements):
        if placement.is_shard() or isinstance(placement, _StridedShard):  # strided: not a Shard subclass
            sharded *= grad.device_mesh.size(dim)
    return world_size // sharded


def _settled(grad: torch.Tensor) -> torch.Tensor:
    if hasattr(grad, "placements") and any(p.is_partial() for p in grad.placements):
        from torch.distributed.tensor import Replicate

        return grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    return grad


def grad_norm(model: nn.Module, context, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient, equal on every rank (fp32 scalar). Collective: every rank calls."""
    is_inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=context.device)
    # pipeline stages hold different parameters: an element lives on the ranks of its own stage only (world / pp),
    # and a tied tensor with copies on several stages (their gradients summed alike) counts on the lowest one
    stage_ranks = context.world_size // context.pp_size
    skip = set()
    if context.pp_size > 1:
        from ..pipeline.stage import tied_duplicates

        skip = tied_duplicates(model)
    for name, param in model.named_parameters():  # each tied parameter once
        if param.grad is None or name in skip:
            continue
        grad = _settled(param.grad)
        local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
        if local.numel() == 0:  # an FSDP2 shard can be empty
            continue
        value = torch.linalg.vector_norm(local.detach().float(), norm_type).to(total.device)
        total = torch.maximum(total, value) if is_inf else \
            total + value.pow(norm_type) / _holders(grad, stage_ranks)
    if context.world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM)
    return total if is_inf else total.pow(1.0 / norm_type)

