"""``save_pretrained`` of a native or generic model through the distributed writer (``hub_export``): one path.

The model says what it holds (``export_pieces``: the plan's layouts for a native model, DTensor placements for a
generic one) and which Hub keys its tensors become (``hub_keys``); the writer does the rest, the same for both.
The configs are what each path wrote before: a native model's ``config.json`` with ``architectures`` set to its
class and ``dtype`` to the saved weights' dtype; a generic model's as ``transformers``' ``save_pretrained`` writes
it (its ``distributed_config`` dropped), and ``generation_config.json`` for models that generate.
"""
from __future__ import annotations

import copy

from .hub_export import DEFAULT_BUFFER_BYTES, export_hub_folder


def _class_name(model) -> str:
    return type(model).__name__.removeprefix("FSDP")  # FSDP2 renames the class of the modules it wraps


def hub_configs(model, generic: bool):
    """``(config, generation config or None)`` as the Hub folder gets them (copies; ``dtype`` is set on write)."""
    config = copy.deepcopy(model.config)
    if generic and hasattr(config, "distributed_config"):
        del config.distributed_config
    config.architectures = [_class_name(model)]
    return config, copy.deepcopy(model.generation_config) if model.can_generate() else None


def _config_writer(model, generic: bool):
    config, generation_config = hub_configs(model, generic)

    def write(folder: str, floating_dtypes) -> None:
        dtypes = sorted(floating_dtypes, key=str)
        if len(dtypes) == 1 or (generic and dtypes):
            config.dtype = dtypes[0] if len(dtypes) == 1 else model.dtype
        config.save_pretrained(folder)
        if generation_config is not None:
            generation_config.save_pretrained(folder)

    return write


def export_model(model, save_directory, *, max_shard_size="5GB", buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> dict:
    """Write ``model`` (native or generic, unwrapped from DDP; FSDP2 and pipeline stages as they are) as a plain
    Hub folder, every rank writing its share. Collective. Returns this rank's statistics (``hub_export``)."""
    from ..generic import is_generic
    from .export_pieces import generic_entries, native_entries
    from .hub_keys import convert_whole

    generic = is_generic(model)
    return export_hub_folder(model.parallel_context, (lambda: generic_entries(model)) if generic else
                             (lambda: native_entries(model)), save_directory,
                             write_configs=_config_writer(model, generic), max_shard_size=max_shard_size,
                             buffer_bytes=buffer_bytes, convert=lambda name, full: convert_whole(model, name, full))
