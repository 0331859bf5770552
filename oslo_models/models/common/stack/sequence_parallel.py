"""The two explicit sequence-parallel boundaries of an encoder/decoder stack.

Between them the residual stream is ``[b, s/tp, h]`` (this rank's contiguous slice of the tokens); outside them
every public tensor keeps HF's ``[b, s, h]``.
"""
from __future__ import annotations

import logging

import torch

from ....parallel_layers.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region

logger = logging.getLogger(__name__)


def use_sequence_parallel(model, seq_len: int) -> bool:
    """Whether this call runs sequence parallelism: it is on in ``model.parallel_context`` and the sequence
    splits evenly. Otherwise (one-token decode steps, odd lengths) the call runs plain tensor parallelism, which
    gives the same numbers with more communication; a training step that falls back warns once."""
    context = model.parallel_context
    if not context.sequence_parallel:
        return False
    if seq_len % context.tp_size == 0:
        return True
    if model.training and not getattr(model, "_warned_sequence_parallel", False):
        logger.warning("sequence_parallel is on but seq_len=%d is not divisible by tensor_parallel_size=%d; "
                       "running those steps without it", seq_len, context.tp_size)
        model._warned_sequence_parallel = True
    return False


def enter_sequence_parallel(hidden_states: torch.Tensor, context) -> torch.Tensor:
    """``[b, s, h]`` replicated -> ``[b, s/tp, h]``. Forward: split. Backward: all-gather."""
    return scatter_to_sequence_parallel_region(hidden_states, context.tp_group)


def leave_sequence_parallel(hidden_states: torch.Tensor, context) -> torch.Tensor:
    """``[b, s/tp, h]`` -> ``[b, s, h]``. Forward: all-gather. Backward: split, because every consumer of the
    stack's output (heads, cross-attention k/v) hands back full, identical gradients on every rank."""
    return gather_from_sequence_parallel_region(hidden_states, context.tp_group, grad_is_partial=False)
