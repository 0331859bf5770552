"""Data parallelism over the data-parallel group only (never across tensor-parallel ranks)."""
from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .context import ParallelContext
from .expert_parallel import expert_parameter_names, register_expert_gradient_reduction


def data_parallel(model: nn.Module, context: ParallelContext | None = None, **ddp_kwargs) -> nn.Module:
    """Wrap ``model`` in torch DDP over ``context.dp_group``; return it unchanged when there is one replica.

    Gradients are averaged over the ranks that hold the *same* shard (same tp rank, different dp rank), so each
    tensor-parallel shard is averaged with its own replicas only. Feed every rank of one TP group the same batch
    and different data-parallel ranks different batches (``oslo_models.data`` samplers do this).

    Under context parallelism the group is dp x cp (``context.dp_cp_group``): cp ranks hold the same weights.

    With ``expert_parallel_size > 1`` the stacked expert weights are left out of DDP and reduced over the
    expert-data-parallel group instead (``distributed/expert_parallel.py``).
    """
    context = context or model.parallel_context
    if context.dp_cp_size == 1:
        return model
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    experts = expert_parameter_names(model) if context.ep_size > 1 else []
    if experts:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    # dp_cp: the dp group, or dp x cp flattened under context parallelism (cp ranks hold the same weights; their
    # losses are scaled so that this average sums their partial gradients, see parallel_layers/context_parallel).
    wrapped = DistributedDataParallel(model, process_group=context.dp_cp_group, device_ids=device_ids, **ddp_kwargs)
    if experts:
        register_expert_gradient_reduction(model, wrapped)
    return wrapped
