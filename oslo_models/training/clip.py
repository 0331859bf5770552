"""Gradient norm and clipping that are right for tensor-, data- and ZeRO-sharded gradients.

``torch.nn.utils.clip_grad_norm_`` on one rank of a tensor-parallel model sees only that rank's shards and would
clip each rank by a different norm; Accelerate's ``clip_grad_norm_`` does the same with plain tensors. The norm of
the *whole* model's gradient is assembled from the pieces each rank holds, using the model's parallel plan (the one
place that says which parameter is split):

- a parameter split over the tensor-parallel group (its layout's ``split``) contributes once per shard: its
  partial sums are added over the tp group;
- a replicated parameter (norms, biases of row-parallel layers) holds the same gradient on every tp rank and is
  counted once: no reduction over tp;
- under ZeRO-2/3 (FSDP2) every gradient is additionally split over the dp group (a DTensor): partial sums are added
  over the group it is sharded over (dp; dp x cp under context parallelism; under HSDP the shard group only, the
  replicate groups holding the same shards); under DDP/ZeRO-1 gradients are already identical over dp and are not
  reduced again;
- stacked expert weights split over the expert-parallel group (layout axis ``"ep"``) hold different experts
  on each ep rank and the same on every tp rank: their partial sums are added over ep only;
- pipeline stages hold different parameters: partial sums are added over pp; a tied tensor with copies on several
  stages (input and output embedding) is counted once, on the lowest pipeline rank holding it.

Collectives: one all-reduce over the dp shard group (only for FSDP2 gradients), one over tp, one over pp, each of
two numbers.
Padded vocabulary rows have zero gradient, so they do not change the norm.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..pipeline.stage import tied_duplicates
from ..utils.model_protocol import protocol_of
from ..utils.modules import unwrap_model
from ..utils.training_state import training_state
from .mixed_precision import mark_overflow


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a gradient: a DTensor's local shard (FSDP2), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _replicated_over_dp(grad) -> bool:
    """An FSDP2 gradient with no sharded mesh dimension (``block_plan``'s ``shard=False`` blocks): whole on every
    dp rank, while it is summed over the dp shard group with the sharded ones."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return False
    sizes = grad.device_mesh.shape  # its (dp_replicate, dp_shard=1) mesh: Shard(0) over one rank is whole
    return not any(p.is_shard() and size > 1 for p, size in zip(placements, sizes))


def _all_reduce(values: torch.Tensor, group, op) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(values, op=op, group=group)
    return values


def _stated_layouts(model: nn.Module) -> dict:
    """Layouts of parameters the plan does not know, stated by their module (``adapter_param_layouts()``: the LoRA
    adapters of ``oslo_models.adapters``, e.g. ``lora_B`` split by output under a column-parallel layer), by full
    parameter name."""
    out = {}
    for prefix, module in model.named_modules():
        layouts = getattr(type(module), "adapter_param_layouts", None)
        if layouts is not None:
            out.update({f"{prefix}.{key}": layout for key, layout in layouts(module).items()})
    return out


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the full model's gradient, equal on every rank (fp32 scalar on the parameters' device).

    ``norm_type``: a positive real p (default 2) or ``inf``. Call on every rank (collective).
    """
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    inner = unwrap_model(model)
    if protocol_of(inner).layout == "placements":  # its gradients' DTensor placements say where they live
        from .clip_placements import grad_norm as placements_grad_norm

        return placements_grad_norm(inner, inner.parallel_context, norm_type)
    context, plan = inner.parallel_context, inner.parallel_plan
    stated = _stated_layouts(inner)
    is_inf = math.isinf(norm_type)
    split, replicated, experts = [], [], []  # per-tensor partial values: sum of |g|^p, or max |g| for inf
    dp_sharded = False
    device = context.device
    skip = tied_duplicates(inner) if context.pp_size > 1 else set()
    for name, param in inner.named_parameters():
        if param.grad is None or name in skip:
            continue
        dp_sharded |= hasattr(param.grad, "to_local")
        local = _local(param.grad)
        device = local.device
        if local.numel() == 0:  # an FSDP2 shard can be empty when dim 0 is smaller than dp
            continue
        value = torch.linalg.vector_norm(local.detach().float(), norm_type)
        value = value if is_inf else value.pow(norm_type)
        spec = stated[name] if name in stated else plan.shard_spec(inner, name)
        if spec.axis == "ep" and spec.split:  # counted once over the tp ranks holding the same piece (below)
            experts.append(value if is_inf else value / spec.num_replicas(context))
            continue
        sharded = context.tp_size > 1 and spec.split
        if sharded and not is_inf:  # a piece held by several tp ranks (a replicated key/value head, a 2D bias)
            # is counted once; the layout weighs the blocks of a whole tp piece (packed q|k|v with replicated
            # key/value heads), a ZeRO-3 shard of it (a DTensor's local rows) by one count
            value = (value / spec.num_replicas(context) if hasattr(param.grad, "to_local")
                     else spec.norm_share(local.detach().float(), norm_type, context))
        if not is_inf and _replicated_over_dp(param.grad):  # a per-block plan's replicated block: the same
            # summed on every dp rank: count once
            value = value / dist.get_world_size(training_state(inner).fsdp_shard_group)
        (split if sharded else replicated).append(value)

    def combine(values):
        if not values:
            return torch.zeros((), device=device)
        stacked = torch.stack([v.to(device) for v in values])
        return stacked.max() if is_inf else stacked.sum()

    parts = torch.stack([combine(split), combine(replicated), combine(experts)])
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    if dp_sharded:  # the group FSDP2 spread the shards over (zero.py), dp for older wrappings
        _all_reduce(parts, training_state(inner).fsdp_shard_group or context.dp_group, op)
    # Only the tp-split part is reduced over tp; the replicated part is already the full value on every tp rank.
    split_total = _all_reduce(parts[0].clone(), context.tp_group, op)
    # each ep rank holds other experts; under FSDP2 the dp all-reduce above already added every (ep, edp) piece
    expert_total = parts[2] if dp_sharded else _all_reduce(parts[2].clone(), context.ep_group, op)
    # expert tensor parallelism: the tp ranks hold different slices (each counted 1 / its replicas above)
    expert_total = _all_reduce(expert_total.clone(), context.tp_group, op)
    total = torch.maximum(torch.maximum(split_total, parts[1]), expert_total) if is_inf else \
        split_total + parts[1] + expert_total
    total = _all_reduce(total, context.pp_group, op)
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *, accelerator=None,
                    optimizer=None) -> torch.Tensor:
    """Scale all gradients of ``model`` so that their global norm is at most ``max_norm``; return the norm
    before clipping (same value on every rank).

    With ``accelerator`` (fp16 loss scaling), the gradients are unscaled first through
    ``accelerator.unscale_gradients(optimizer)``, and a non-finite global norm marks the step as overflowed on
    *every* rank (one rank's shard may hold the inf the others do not see), so all ranks skip it together.
    Use it in place of ``accelerator.clip_grad_norm_`` for ``oslo_models`` models.
    """
    if max_norm is None or not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm!r}")
    if accelerator is not None:
        accelerator.unscale_gradients(optimizer)
    total = grad_norm(model, norm_type)
    if accelerator is not None and not torch.isfinite(total):
        mark_overflow(accelerator.scaler)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in unwrap_model(model).parameters():
        if param.grad is not None:
            local = _local(param.grad)
            local.mul_(coef.to(local.device, local.dtype))
    return total
