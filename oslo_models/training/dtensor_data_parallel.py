"""Data parallelism at ZeRO stage 0/1 for a model whose parameters are DTensors (e.g. tensor parallel through a
``transformers`` plan on the generic path).

torch DDP and ``ZeroRedundancyOptimizer`` cannot hold DTensors (their flat buckets and broadcasts have no sharding
rule), so ``training.shard_data_parallel`` hands such a model (any kind: it asks the parameters, not the model) to
:func:`shard_dtensor_data_parallel`:

- :func:`average_gradients_over_dp`: each parameter's gradient is all-reduced over the dp group once it is
  accumulated (DDP without buckets; under gradient accumulation this averages at every micro-step, which gives the
  same mean);
- stage 1: :class:`ShardedStateOptimizer` (ZeRO-1: each dp rank keeps the optimizer state of the parameters it owns,
  steps them, and broadcasts their new local values over dp; an expert split over ep is owned by one rank of the
  ranks holding the same experts, ``edp``, and broadcast over them).

FSDP2 (stages 2/3) shards DTensors again over dp (2D) and needs nothing from here. Experts split over ``ep``
(``generic/expert_parallel.py``) reduce over the ranks holding the same experts instead.

Collectives: per parameter, one all-reduce of its local gradient over dp per backward; per ZeRO-1 step, one
broadcast over dp per parameter from its owner.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..utils.modules import constructor_defaults
from ..utils.training_state import update_training_state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def has_dtensor_parameters(model: nn.Module) -> bool:
    return any(hasattr(param, "device_mesh") for param in model.parameters())


def _is_expert(param) -> bool:
    """Split over an expert-parallel mesh dimension (``ep``): other ranks of dp hold other experts."""
    mesh = getattr(param, "device_mesh", None)
    return mesh is not None and "ep" in (mesh.mesh_dim_names or ())


def average_gradients_over_dp(model: nn.Module, context) -> None:
    """After each backward, every gradient is the mean over the dp group (``dp x cp`` under context parallelism: cp
    ranks hold the same weights and their chunks' shares add up; registered once, on the parameters). Experts split
    over ``ep`` (``generic/expert_parallel.py``): each incoming gradient, before it is accumulated, is summed over the
    ranks holding the same experts (``edp``) and divided by ``dp x cp`` (the all-to-all backward already summed the
    ``ep`` ranks' tokens; ep is carved out of ``dp x cp``)."""
    group, size = context.dp_cp_group, context.dp_cp_size

    def reduce(param: torch.Tensor) -> None:
        grad = param.grad
        if hasattr(grad, "placements") and grad.placements != param.placements:
            # keep the parameter's layout, so the local tensors of all dp ranks hold the same elements
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        local = _local(grad)
        local.div_(size)
        dist.all_reduce(local, group=group)

    expert_group = _expert_group(model, context)

    def reduce_expert(grad: torch.Tensor) -> torch.Tensor:
        grad = grad / size
        if expert_group is not None:
            dist.all_reduce(_local(grad), group=expert_group)
        return grad

    for param in model.parameters():
        if param.requires_grad and _is_expert(param):
            param.register_hook(reduce_expert)
        elif param.requires_grad:
            param.register_post_accumulate_grad_hook(reduce)


def _expert_group(model: nn.Module, context):
    """The process group of the ranks holding this rank's experts (``edp``); ``None`` without experts or at edp 1."""
    if not any(_is_expert(param) for param in model.parameters()):
        return None
    from ..utils.model_protocol import protocol_of

    edp = protocol_of(model).expert_data_parallel_mesh(model, context)
    return edp.get_group() if edp.size() > 1 else None


def _partition(params: list[torch.Tensor], size: int) -> list[int]:
    """The dp rank owning each parameter: greedy by local size, largest first (deterministic on every rank of a dp
    group, whose local shapes are equal)."""
    load = [0] * size
    owner = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: -_local(params[i]).numel()):
        rank = min(range(size), key=lambda r: load[r])
        owner[index] = rank
        load[rank] += _local(params[index]).numel()
    return owner


class ShardedStateOptimizer(torch.optim.Optimizer):
    """ZeRO-1 for DTensor parameters: ``optimizer``'s class and param groups, the state of each parameter kept on
    one dp rank only.

    ``param_groups`` hold every parameter (schedulers and ``zero_grad`` see the whole model); ``optim`` is the inner
    optimizer over this rank's own parameters (its ``state`` is what this rank holds, as in torch's
    ``ZeroRedundancyOptimizer``). ``step`` copies the group hyperparameters in, steps the own parameters, then
    broadcasts every parameter's local tensor from its owner over the dp group; experts split over ep
    (``expert_group``: the ranks holding the same experts) are owned and broadcast within that group."""

    def __init__(self, optimizer: torch.optim.Optimizer, context, defaults: dict, expert_group=None):
        groups = [dict(group) for group in optimizer.param_groups]
        super().__init__(groups, defaults)
        params = [param for group in self.param_groups for param in group["params"]]
        self._owner = {}  # id(param) -> (group, global rank of the owner)
        dense_ranks = context.axis("dp").ranks
        for expert, group, ranks in ((False, context.dp_group, dense_ranks),
                                     (True, expert_group, _group_ranks(expert_group, context.rank))):
            chosen = [param for param in params if _is_expert(param) == expert]
            for param, owner in zip(chosen, _partition(chosen, len(ranks))):
                self._owner[id(param)] = (group, ranks[owner])
        mine = [{**{k: v for k, v in group.items() if k != "params"},
                 "params": [p for p in group["params"] if self._owner[id(p)][1] == context.rank]}
                for group in self.param_groups]
        self.optim = type(optimizer)(mine, **defaults) if any(g["params"] for g in mine) else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self.optim is not None:
            for outer, inner in zip(self.param_groups, self.optim.param_groups):
                inner.update({k: v for k, v in outer.items() if k != "params"})  # e.g. a scheduler's lr
            self.optim.step()
        for group in self.param_groups:
            for param in group["params"]:
                owner_group, owner = self._owner[id(param)]
                if owner_group is not None:
                    dist.broadcast(_local(param), src=owner, group=owner_group)
        return loss


def _group_ranks(group, rank: int) -> tuple[int, ...]:
    """The global ranks of ``group`` (just ``rank`` when ``None``: a group of one)."""
    return tuple(dist.get_process_group_ranks(group)) if group is not None else (rank,)


def shard_dtensor_data_parallel(model: nn.Module, optimizer, context, stage: int, ddp_kwargs: dict):
    """Stages 0/1 of ``training.shard_data_parallel`` for a model whose parameters are DTensors."""
    if ddp_kwargs:
        raise ValueError(f"DDP options {sorted(ddp_kwargs)} do not apply to a model with DTensor parameters (torch "
                         f"DDP cannot hold them; gradients are averaged over dp by hooks instead)")
    average_gradients_over_dp(model, context)
    if stage == 1 and optimizer is not None:
        optimizer = ShardedStateOptimizer(optimizer, context, constructor_defaults(optimizer),
                                          expert_group=_expert_group(model, context))
    update_training_state(model, zero_stage=stage)
    return model, optimizer
