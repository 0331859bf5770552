"""Which group reduces which gradient when experts are split over an expert-parallel group.

Expert parallelism (``ParallelConfig.expert_parallel_size = ep``) is carved out of the data-parallel ranks: the
``dp`` ranks of one replica group are cut into ``dp/ep`` expert-parallel groups (under context parallelism the
``dp x cp`` ranks, which hold the same weights, are: an ep group may hold chunks of one sequence, and ``dp`` below
reads ``dp x cp``). Every rank still sees its own
batch; the stacked expert weights (layout axis ``"ep"`` in the model's parallel plan, the one place that
says it) are split over ``ep``, everything else is replicated over ``dp`` as before. So:

==========================  =====================================  ==============================================
parameters                  reduced over                           scale
==========================  =====================================  ==============================================
stacked experts (axis ep)   ``edp`` (``dp/ep`` ranks with the      sum, then ``/ dp``: the all-to-all backward
                            same experts)                          already summed the ``ep`` ranks' tokens
everything else             ``dp`` (torch DDP)                     mean over ``dp``
==========================  =====================================  ==============================================

With this, every gradient equals the mean over all ``dp`` ranks' losses, as in plain data parallelism.
Optimizer-state sharding (ZeRO-1) likewise shards each kind over its own group (``split_optimizer``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names (as ``model.named_parameters()`` gives them) of the parameters the plan splits over the
    expert-parallel group. ``model`` may be a ``torch.compile`` module: its names carry ``_orig_mod.``, while the
    plan knows the model's own names (without this, DDP and FSDP2 took a compiled model's experts for dense
    weights and averaged them over dp)."""
    inner = getattr(model, "_orig_mod", model)
    prefix = "" if inner is model else "_orig_mod."
    plan = inner.parallel_plan
    return [prefix + name for name, _ in inner.named_parameters() if plan.shard_spec(inner, name).axis == "ep"]


def register_expert_gradient_reduction(model: nn.Module, ddp: nn.Module | None = None) -> None:
    """Reduce expert gradients over the expert-data-parallel group after each backward (sum, then ``/ dp``).

    Runs as a post-accumulate-grad hook on each stacked expert tensor (one per layer: every local expert's weights
    are one tensor, used by every forward even with no tokens, so the hook fires on every rank, in the same
    order). With ``ddp``, it follows DDP's ``no_sync`` (no reduction on accumulation micro-steps).
    Collective per hook: one all-reduce over ``edp`` (none when ``edp`` has one rank).
    """
    context = model.parallel_context
    group, dp_size = context.edp_group, context.dp_cp_size  # dense gradients are averaged over dp x cp
    params = dict(model.named_parameters())

    def reduce(param: torch.Tensor) -> None:
        if ddp is not None and not ddp.require_backward_grad_sync:
            return
        if group is not None:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(dp_size)

    for name in expert_parameter_names(model):
        params[name].register_post_accumulate_grad_hook(reduce)


class SplitOptimizer(torch.optim.Optimizer):
    """One optimizer over several inner optimizers (ZeRO-1 of the dense parameters over ``dp`` and of the
    experts over ``edp``). Its ``param_groups`` are its own; hyperparameters (a scheduler's ``lr``) are copied to
    the inner groups before each step, as ``ZeroRedundancyOptimizer`` does for its local optimizer."""

    def __init__(self, inner: list[tuple[torch.optim.Optimizer, list[int]]], groups: list[dict], defaults: dict):
        super().__init__([dict(group) for group in groups], defaults)
        self.inner = inner  # (optimizer, indices of self.param_groups it owns, in its group order)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closures are not supported with expert-parallel ZeRO-1")
        for optimizer, owned in self.inner:
            for mine, theirs in zip(owned, optimizer.param_groups):
                theirs.update({k: v for k, v in self.param_groups[mine].items() if k != "params"})
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        for optimizer, _ in self.inner:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        raise NotImplementedError("a ZeRO-1 optimizer with expert_parallel_size > 1 has no single state_dict (each "
                                  "rank holds a shard of each kind); save it with oslo_models.training."
                                  "save_checkpoint")


def split_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, build) -> torch.optim.Optimizer:
    """ZeRO-1 with experts: ``build(groups, process_group)`` builds the sharded optimizer of ``groups`` over
    ``process_group``; dense parameters go over ``dp``, experts over ``edp`` (a plain optimizer when ``edp`` has
    one rank). Param groups keep their hyperparameters and order."""
    context = model.parallel_context
    names = set(expert_parameter_names(model))
    experts = {id(p) for name, p in model.named_parameters() if name in names}
    dense_groups, expert_groups, dense_idx, expert_idx = [], [], [], []
    for i, group in enumerate(optimizer.param_groups):
        for kind, out, idx in ((False, dense_groups, dense_idx), (True, expert_groups, expert_idx)):
            params = [p for p in group["params"] if (id(p) in experts) == kind]
            if params:
                out.append({**group, "params": params})
                idx.append(i)
    inner = [(build(dense_groups, context.dp_cp_group), dense_idx)] if dense_groups else []
    if expert_groups:
        inner.append((build(expert_groups, context.edp_group), expert_idx))
    return SplitOptimizer(inner, optimizer.param_groups, optimizer.defaults)
