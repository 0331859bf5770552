"""What ``prepare`` / ``shard_data_parallel`` / asynchronous checkpoints set on a model: one named record (and
:class:`ModelRecord`, the slot such a frozen per-model record lives in; ``generic/install_state.py`` keeps the
generic path's install record in one too).

``training/prepare.py``, ``training/zero.py``, ``training/dtensor_data_parallel.py`` and
``training/async_checkpoint.py`` write it (one place per concern, through :func:`update_training_state`); the gradient
clip, the trainer, the checkpoints and the pipeline runner / stages read it with :func:`training_state`. It sits in
``utils/`` because ``pipeline/`` reads it and ``training/`` imports ``pipeline/``. No collective.

The record lives on the innermost model (:func:`state_owner`: inside torch DDP's ``.module``, a ``torch.compile``
module's ``_orig_mod`` and a ``peft`` wrapper's base model; FSDP2 keeps the model object itself), so the model and
its wrappers all report the same state. Nothing global: a model that was never prepared reports ``TrainingState()``
(every field unset).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .modules import unwrap_model


@dataclass(frozen=True, kw_only=True)
class TrainingState:
    """The runtime training state of one model (replaced as a whole; fields are ``None`` until set).

    Attributes:
        zero_stage: the ZeRO stage ``shard_data_parallel`` prepared the model with (0-3); ``None``: not prepared.
        stage_modules: pipeline x ZeRO-2/3: ``{stage index: StageModule}``, the FSDP2 roots of this rank's stages,
            built once and reused by the runner's schedules.
        fsdp_shard_group: ZeRO-2/3: the process group FSDP2 spread the shards over (the gradient norm all-reduces
            its dp partial sums over it).
        autocast_dtype: pipeline x mixed precision: the dtype each stage autocasts to (``prepare``'s bf16 / fp16).
        grad_scaler: pipeline x fp16: Accelerate's ``GradScaler`` that ``train_step`` scales each microbatch's loss
            with.
        async_writer: the model's background checkpoint writer (``training/async_checkpoint.AsyncWriter``), made on
            the first asynchronous save.
        gradients_reduced_by: who reduces the gradients over dp x cp (``"ddp"``, ``"zero1"``, ``"fsdp2 zero3"``,
            ``"pipeline"``, ``"caller"``...; ``distributed.mark_gradients_reduced``), which silences the
            data-parallel guard; ``None``: nobody said so yet.
        pipeline_runner: a pipelined model's ``pipeline.runner.PipelineRunner``, built on its first ``train_step`` /
            ``eval_step`` (``pipeline.runner.pipeline_runner``).
        adapter_export_guard: a parallel model with ``peft`` adapters: the handle of the state-dict pre-hook that
            refuses an adapter export the layout cannot gather (``adapters/saving.guard_adapter_export``), set once.
    """

    zero_stage: int | None = None
    stage_modules: Mapping[int, nn.Module] | None = None
    fsdp_shard_group: Any = None
    autocast_dtype: torch.dtype | None = None
    grad_scaler: Any = None
    async_writer: Any = None
    gradients_reduced_by: str | None = None
    pipeline_runner: Any = None
    adapter_export_guard: Any = None


def state_owner(model: nn.Module) -> nn.Module:
    """The model object that holds the state: inside DDP (``.module``), ``torch.compile`` (``_orig_mod``) and
    ``peft``'s wrapper (its base model)."""
    while True:
        model = unwrap_model(model)
        # `is None`, never `or`: a wrapped torch.compile module has no truth value (its __len__ raises TypeError)
        compiled = model.__dict__.get("_modules", {}).get("_orig_mod")
        if compiled is not None:
            model = compiled
            continue
        if callable(getattr(type(model), "get_base_model", None)):  # peft's PeftModel (transformers has none)
            model = model.get_base_model()
            continue
        return model


class ModelRecord:
    """The slot of one frozen per-model record (a dataclass), kept in the ``__dict__`` of the model's
    :func:`state_owner` under ``attribute`` (not a parameter, buffer or submodule); ``unset`` is what a model without
    one reports."""

    def __init__(self, attribute: str, unset):
        self.attribute, self.unset = attribute, unset

    def read(self, model: nn.Module):
        return state_owner(model).__dict__.get(self.attribute, self.unset)

    def update(self, model: nn.Module, **changes):
        """Set the given fields (the others are kept); returns the new record. An unknown field raises ``TypeError``."""
        owner = state_owner(model)
        record = dataclasses.replace(owner.__dict__.get(self.attribute, self.unset), **changes)
        owner.__dict__[self.attribute] = record
        return record


_RECORD = ModelRecord("oslo_training_state", TrainingState())


def training_state(model: nn.Module) -> TrainingState:
    """The :class:`TrainingState` of ``model`` (or of the model inside its DDP / ``peft`` wrapper)."""
    return _RECORD.read(model)


def update_training_state(model: nn.Module, **changes) -> TrainingState:
    """Set the given :class:`TrainingState` fields of ``model`` (the others are kept); returns the new record.
    An unknown field name raises ``TypeError``."""
    return _RECORD.update(model, **changes)
