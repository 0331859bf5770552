"""What the generic path installed on one ``transformers`` model: one named, frozen record (``GenericInstall``),
instead of private attributes on the model.

``loading.py`` writes it while it builds the model (the resolved tensor-parallel plan, the sequence-parallel regions,
the expert mesh, the pipeline adapter, the training fixes it installed); ``protocol.py``, ``pipeline_stage.py``,
``sequence_parallel.py`` and :func:`oslo_models.generic.is_generic` read it. It lives where the model's
``TrainingState`` lives (``utils/training_state.py``: the model inside its DDP / ``torch.compile`` / ``peft``
wrappers). No collective.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..utils.training_state import ModelRecord


@dataclass(frozen=True, kw_only=True)
class GenericInstall:
    """The generic path's install record of one model (replaced as a whole; fields unset until set).

    Attributes:
        tp_plan: the resolved tensor-parallel plan ``{module or parameter name: style}`` (``{}`` at tp 1); set on
            every model the generic path loaded, so its presence marks the generic path.
        sequence_parallel: ``(layers, regions)`` of ``sequence_parallel.regions`` when the layers run on sequence
            slices; ``None`` otherwise.
        vocab_parallel_loss: whether the causal LM's loss runs on its logits' vocabulary slices.
        tp_output_copies: outputs of plan modules the model modifies in place (``inplace_outputs.py``).
        tp_partial_gradients: replicated parameters fed by tp slices, gradients summed over tp
            (``partial_gradients.py``).
        vocab_slice_gradients: vocabulary-split embeddings that keep only their rows' gradient
            (``vocab_embedding.py``).
        expert_mesh: the ``ep`` x ``edp`` mesh the experts were split on (``expert_parallel.py``).
        pipeline_adapter: the adapter the model was cut with (``pipeline_stage.cut``).
        packed_attention_hook: the handle of the packed-documents pre-hook (``packed_attention.install``), set once.
        context_parallel_calls: while ``context_parallel.install`` checks a pipelined model: the list each stage
            appends its ``ContextParallelCall`` to; ``None`` otherwise.
    """

    tp_plan: Mapping[str, str] | None = None
    sequence_parallel: tuple | None = None
    vocab_parallel_loss: bool = False
    tp_output_copies: Any = None
    tp_partial_gradients: Any = None
    vocab_slice_gradients: Any = None
    expert_mesh: Any = None
    pipeline_adapter: Any = None
    packed_attention_hook: Any = None
    context_parallel_calls: list | None = None


_RECORD = ModelRecord("oslo_generic_install", GenericInstall())


def generic_install(model: nn.Module) -> GenericInstall:
    """The :class:`GenericInstall` of ``model`` (every field unset for a model the generic path did not load)."""
    return _RECORD.read(model)


def update_generic_install(model: nn.Module, **changes) -> GenericInstall:
    """Set the given :class:`GenericInstall` fields of ``model`` (the others are kept); returns the new record."""
    return _RECORD.update(model, **changes)


def installed_on(model: nn.Module) -> GenericInstall | None:
    """The record held by ``model`` itself (no unwrapping), or ``None``."""
    return getattr(model, "__dict__", {}).get(_RECORD.attribute)
