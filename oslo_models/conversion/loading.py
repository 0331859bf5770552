"""Fill a (tensor-parallel) model from a checkpoint, each rank reading only the slices it owns.

The model arrives with parameters already allocated at their local shapes (``to_empty`` after a meta build).
For every parameter the model's ``ParallelPlan`` gives its ``Layout`` (``parallel_layers/sharding.py``); the layout cuts
this rank's piece out of the checkpoint through ``CheckpointReader.read`` (a safetensors slice), so peak host memory is
the local shard plus one tensor piece, never the full model.

Checkpoint keys are matched to parameter names the way ``transformers`` does: exactly, or with the base-model
prefix added or removed (``h.0.attn.c_attn.weight`` <-> ``transformer.h.0.attn.c_attn.weight``).
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from .checkpoint import CheckpointReader

logger = logging.getLogger(__name__)


class MismatchedSizeError(ValueError, RuntimeError):
    """A checkpoint tensor whose shape does not fit the model (``transformers`` raises ``RuntimeError`` here)."""


def match_checkpoint_keys(param_names: list[str], checkpoint_keys, base_model_prefix: str) -> dict[str, str]:
    """Parameter name -> checkpoint key, allowing the base-model prefix to be present on one side only."""
    available = set(checkpoint_keys)
    prefix = base_model_prefix + "." if base_model_prefix else ""
    mapping = {}
    for name in param_names:
        candidates = [name]
        if prefix and name.startswith(prefix):
            candidates.append(name[len(prefix):])
        elif prefix:
            candidates.append(prefix + name)
        for candidate in candidates:
            if candidate in available:
                mapping[name] = candidate
                break
    return mapping


def init_full_tensor(name: str, shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """``transformers``' default init for a parameter missing from the checkpoint (a new head, say)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if len(shape) == 1:  # norm scale
        return torch.ones(shape)
    return torch.randn(shape, generator=generator) * std


def load_checkpoint_into(model: nn.Module, reader: CheckpointReader, *, plan, context, base_model_prefix: str,
                         init_std: float = 0.02, seed: int = 0, strict_shapes: bool = True,
                         progress: bool = False, ignore_mismatched_sizes: bool = False) -> dict[str, list]:
    """Copy this rank's slice of every checkpoint tensor into ``model``; returns missing/unexpected keys and, with
    ``ignore_mismatched_sizes``, the ``(key, checkpoint shape, model shape)`` of tensors whose full shape differs
    (those are newly initialized, as ``transformers`` does for a new head with another ``num_labels``)."""
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    mapping = match_checkpoint_keys(list(params), reader.keys(), base_model_prefix)
    missing = [name for name in params if name not in mapping]
    used = set(mapping.values()) | _load_persistent_buffers(model, reader, base_model_prefix)
    ignore_patterns = tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    unexpected = [key for key in reader.keys() if key not in used
                  and not any(pattern in key for pattern in ignore_patterns)
                  and not _is_tied_duplicate(model, key, base_model_prefix)]

    mismatched = []
    if ignore_mismatched_sizes:
        for name, param in params.items():
            if name in mapping:
                spec = plan.shard_spec(model, name)
                full_shape = spec.full_shape_of(tuple(param.shape), context)
                key = mapping[name]
                if tuple(reader.shape(key)) != tuple(full_shape):
                    mismatched.append((key, tuple(reader.shape(key)), tuple(full_shape)))
                    del mapping[name]  # initialized below like a missing weight
    generator = torch.Generator().manual_seed(seed)
    items = list(params.items())
    if progress and context.rank == 0:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="loading shards", unit="tensor")
    with torch.no_grad():
        for name, param in items:
            spec = plan.shard_spec(model, name)
            # what the config says, at any split (tensor-parallel group or grid axes, expert-parallel for experts)
            full_shape = spec.full_shape_of(tuple(param.shape), context)
            if name in mapping:
                key = mapping[name]
                _check_stored_shape(name, key, tuple(reader.shape(key)), full_shape, spec)
                read = lambda index, key=key: reader.read(key, index)  # noqa: E731
            else:
                full = init_full_tensor(name, full_shape, init_std, generator)
                read = lambda index, full=full: full[index]  # noqa: E731
            local = spec.read_local(full_shape, read, context)
            param.copy_(local.to(device=param.device, dtype=param.dtype))
    if missing:
        logger.warning("Some weights of %s were not in the checkpoint and are newly initialized: %s",
                       type(model).__name__, missing)
    if unexpected:
        logger.warning("Some checkpoint weights were not used by %s: %s", type(model).__name__, unexpected)
    if mismatched:  # transformers' wording, on its loading logger, where users and its tests look for it
        hf_logging.get_logger("transformers.modeling_utils").warning(
            "Some weights of %s were not initialized from the checkpoint (Reinit due to size mismatch, "
            "ignore_mismatched_sizes=True): %s", type(model).__name__, mismatched)
    return {"missing_keys": missing, "unexpected_keys": unexpected, "mismatched_keys": mismatched}


def _load_persistent_buffers(model: nn.Module, reader: CheckpointReader, base_model_prefix: str) -> set[str]:
    """Copy the checkpoint's value of every persistent buffer (in the state dict, not a parameter: DeepSeek-V3's
    ``e_score_correction_bias``) whole into the model; buffers are never split. Returns the checkpoint keys read.
    A buffer the checkpoint lacks keeps the value its module gave it (``reset_buffers``)."""
    buffers = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()
               if not isinstance(tensor, nn.Parameter)}
    mapping = match_checkpoint_keys(list(buffers), reader.keys(), base_model_prefix)
    with torch.no_grad():
        for name, key in mapping.items():
            buffers[name].copy_(reader.read(key, None).to(device=buffers[name].device, dtype=buffers[name].dtype))
    return set(mapping.values())


def _check_stored_shape(name: str, key: str, stored: tuple[int, ...], expected: tuple[int, ...], spec) -> None:
    """The stored (full) shape must be the config's full shape exactly, before anything is sliced: padded local
    shapes cannot tell a 99-row vocabulary from a 100-row one, nor a transposed packed q|k|v from the real one."""
    if stored == expected:
        return
    hint = ""
    if len(stored) == 2 and stored[::-1] == expected:
        hint = " (transposed: was it saved with another layout, nn.Linear vs Conv1D?)"
    else:
        hint = spec.describe()
    raise MismatchedSizeError(f"Checkpoint tensor {key!r} has shape {stored}, but the model config needs {expected} "
                              f"for {name!r}{hint}: the checkpoint does not match the config (vocab_size, hidden "
                              "size, heads...; ignore_mismatched_sizes=True initializes such tensors anew, e.g. a "
                              "head with another num_labels)")


def _is_tied_duplicate(model: nn.Module, key: str, prefix: str) -> bool:
    """A checkpoint's copy of a tied weight (``lm_head.weight``) is expected and not 'unexpected'."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return key in tied or (prefix and f"{prefix}.{key}" in tied)


