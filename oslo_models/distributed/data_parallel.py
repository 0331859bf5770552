"""Data parallelism over the data-parallel group only (never across tensor-parallel ranks), and the guard that
keeps it from being inert.

A model whose world has ``dp x cp > 1`` computes, on each rank, the gradient of that rank's rows (and, under context
parallelism, of its sequence chunk) only; something must reduce those gradients over ``dp x cp`` before the
optimizer steps, or the replicas silently drift apart (and cp ranks apply partial gradients). ``finish_init`` calls
:func:`install_data_parallel_guard` on such a model; the wrappers (``data_parallel`` here, ``training.prepare`` /
``shard_data_parallel``: DDP, ZeRO-1, FSDP2) mark the model with :func:`mark_gradients_reduced`. A training-mode
forward of an unmarked model hangs a hook on its output tensors that raises at the first backward. Cost: one
attribute read per forward, no collective. A caller that reduces gradients itself says so with
``mark_gradients_reduced(model, "caller")``.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..utils.training_state import training_state, update_training_state
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
    mark_gradients_reduced(model, "ddp")
    if experts:
        register_expert_gradient_reduction(model, wrapped)
    return wrapped


def mark_gradients_reduced(model: nn.Module, by: str = "caller") -> None:
    """Record that ``by`` (``"ddp"``, ``"zero1"``, ``"fsdp2"``, ``"caller"``...) reduces ``model``'s gradients over
    its data-parallel (x context-parallel) group, which silences :func:`install_data_parallel_guard`. ``model`` may
    be a DDP wrapper, a ``torch.compile`` module or a ``peft`` model: the mark is the ``gradients_reduced_by`` field
    of the ``oslo_models`` model's :class:`~oslo_models.utils.training_state.TrainingState` inside them."""
    update_training_state(model, gradients_reduced_by=by)


def gradients_reduced_by(model: nn.Module) -> str | None:
    """Who reduces ``model``'s gradients over dp x cp (``None``: nobody said so yet)."""
    return training_state(model).gradients_reduced_by


def _refuse_unreduced_backward(model: nn.Module, _args, output):
    # forward hook: only a training-mode forward that records a graph can end in an optimizer step
    if not (model.training and torch.is_grad_enabled()) or training_state(model).gradients_reduced_by is not None:
        return None
    context = model.parallel_context
    message = (f"{type(model).__name__} spans data_parallel_size={context.dp_size} x context_parallel_size="
               f"{context.cp_size} > 1 but nothing reduces its gradients over those ranks: each rank would step on "
               f"its own rows' (and sequence chunk's) gradient only and the replicas would drift apart. Wrap it "
               f"first: model, optimizer = oslo_models.training.prepare(accelerator, model, optimizer) (or "
               f"training.shard_data_parallel / oslo_models.data_parallel); if you reduce the gradients yourself, "
               f"call oslo_models.distributed.mark_gradients_reduced(model, 'caller').")

    def refuse(grad):
        raise RuntimeError(message)

    values = output.values() if isinstance(output, dict) else output if isinstance(output, tuple) else (output,)
    for value in values:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.register_hook(refuse)
    return None


def install_data_parallel_guard(model: nn.Module) -> None:
    """On a model of a world with ``dp x cp > 1`` whose ``forward`` trains locally (no pipeline: the pipeline's
    ``train_step`` reduces over dp x cp itself), make the first backward of an unwrapped training forward raise a
    ``RuntimeError`` that says what to call (see the module docstring)."""
    context = model.parallel_context
    if context.dp_cp_size > 1 and context.pp_size == 1:
        model.register_forward_hook(_refuse_unreduced_backward)
