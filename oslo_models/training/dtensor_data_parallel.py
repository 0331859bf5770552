"""Data parallelism at ZeRO stage 0/1 for a model whose parameters are DTensors (e.g. tensor parallel through a
``transformers`` plan on the generic path).

torch DDP and ``ZeroRedundancyOptimizer`` cannot hold DTensors (their flat buckets and broadcasts have no sharding
rule), so ``training.shard_data_parallel`` hands such a model (any kind: it asks the parameters, not the model) to
:func:`shard_dtensor_data_parallel`:

- :func:`average_gradients_over_dp`: each parameter's gradient is all-reduced over the dp group once it is
  accumulated (DDP without buckets; under gradient accumulation this averages at every micro-step, which gives the
  same mean);
- stage 1: :class:`ShardedStateOptimizer` (ZeRO-1: each dp rank keeps the optimizer state of the parameters it owns,
  steps them, and broadcasts their new local values over dp).

FSDP2 (stages 2/3) shards DTensors again over dp (2D) and needs nothing from here. Experts split over ``ep``
(``generic/expert_parallel.py``) reduce over the ranks holding the same experts instead (ZeRO-1 refused for them).

Collectives: per parameter, one all-reduce of its local gradient over dp per backward; per ZeRO-1 step, one
broadcast over dp per parameter from its owner.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..utils.modules import constructor_defaults


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
    ranks holding the same experts (``edp``) and divided by ``dp`` (the all-to-all backward already summed the ``ep``
    ranks' tokens)."""
    group, size = context.dp_cp_group, context.dp_cp_size

    def reduce(param: torch.Tensor) -> None:
        grad = param.grad
        if hasattr(grad, "placements") and grad.placements != param.placements:
            # keep the parameter's layout, so the local tensors of all dp ranks hold the same elements
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        local = _local(grad)
        local.div_(size)
        dist.all_reduce(local, group=group)

    expert_group = None
    if any(_is_expert(param) for param in model.parameters()):
        from ..utils.model_protocol import protocol_of

        edp = protocol_of(model).expert_data_parallel_mesh(model, context)
        expert_group = edp.get_group() if edp.size() > 1 else None

    def reduce_expert(grad: torch.Tensor) -> torch.Tensor:
        grad = grad / context.dp_size
        if expert_group is not None:
            dist.all_reduce(_local(grad), group=expert_group)
        return grad

    for param in model.parameters():
        if param.requires_grad and _is_expert(param):
            param.register_hook(reduce_expert)
        elif param.requires_grad:
            param.register_post_accumulate_grad_hook(reduce)


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
    broadcasts every parameter's local tensor from its owner over the dp group."""

    def __init__(self, optimizer: torch.optim.Optimizer, context, defaults: dict):
        groups = [dict(group) for group in optimizer.param_groups]
        super().__init__(groups, defaults)
        self._group, self._dp_ranks = context.dp_group, context.axis("dp").ranks
        params = [param for group in self.param_groups for param in group["params"]]
        owners = _partition(params, context.dp_size)
        self._owner = {id(param): owner for param, owner in zip(params, owners)}
        mine = [{**{k: v for k, v in group.items() if k != "params"},
                 "params": [p for p in group["params"] if self._owner[id(p)] == context.dp_rank]}
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
                dist.broadcast(_local(param), src=self._dp_ranks[self._owner[id(param)]], group=self._group)
        return loss


def shard_dtensor_data_parallel(model: nn.Module, optimizer, context, stage: int, ddp_kwargs: dict):
    """Stages 0/1 of ``training.shard_data_parallel`` for a model whose parameters are DTensors."""
    if ddp_kwargs:
        raise ValueError(f"DDP options {sorted(ddp_kwargs)} do not apply to a model with DTensor parameters (torch "
                         f"DDP cannot hold them; gradients are averaged over dp by hooks instead)")
    if stage == 1 and any(_is_expert(param) for param in model.parameters()):
        raise NotImplementedError("zero_stage=1 with experts split over ep (transformers' expert-parallel plan) is not "
                                  "implemented: its optimizer-state owners broadcast over dp, which holds other "
                                  "experts; use zero_stage 0, 2 or 3")
    average_gradients_over_dp(model, context)
    if stage == 1 and optimizer is not None:
        optimizer = ShardedStateOptimizer(optimizer, context, constructor_defaults(optimizer))
    model._oslo_zero_stage = stage
    return model, optimizer
