"""Small module and optimizer helpers that ``training/``, ``pipeline/``, the planner and the generic path share.

They sit below all of those so that none of them imports another for a helper (the generic path once imported
``training.zero`` for these, and ``training.zero`` imported the generic path back). No collective.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP (``.module``); FSDP2 keeps the model object itself."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def unwrap_optimizer(optimizer):
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (kept as ``.optimizer``)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.defaults`` restricted to what its constructor accepts (AdamW's defaults carry keys, such as
    ``decoupled_weight_decay``, that it sets itself); the groups keep every key anyway."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def shares_parameters_outside(prefix: str, module: nn.Module, model: nn.Module) -> bool:
    """Whether a parameter of ``module`` (at ``prefix``) is also registered outside it: a tied weight, e.g. BERT's
    word embeddings are the MLM decoder's weight. FSDP2 lets one parameter belong to one unit only."""
    inside = {id(param) for param in module.parameters()}
    return any(id(param) in inside and not name.startswith(prefix + ".")
               for name, param in model.named_parameters(remove_duplicate=False))


def outermost(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``(prefix, module)`` pairs (pre-order) without those nested in an earlier one."""
    kept = []
    for prefix, module in modules:  # pre-order: a parent comes before its children
        if not any(prefix.startswith(outer + ".") for outer, _ in kept):
            kept.append((prefix, module))
    return kept


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The items of the largest ``nn.ModuleList`` whose items all have one class (a model's layers)."""
    best: list[tuple[str, nn.Module]] = []
    for prefix, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and len({type(m) for m in module}) == 1:
            best = [(f"{prefix}.{index}" if prefix else str(index), item) for index, item in enumerate(module)]
    return best
