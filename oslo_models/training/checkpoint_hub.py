"""What a resumable checkpoint records so that it becomes a Hub folder offline, with no model and no GPU.

``python -m oslo_models checkpoint consolidate`` (``conversion/consolidate.py``) turns a training checkpoint of any
layout into the folder ``save_pretrained`` writes. The tensors are in DCP's entries ``model/<name>`` (layout
independent, each a row-major reshape of the full tensor, so flat element ``i`` of the entry is flat element ``i``
of the tensor); what the files alone do not say is kept in ``hub/`` of each step folder, written by rank 0 before
the checksums (so ``checkpoint verify`` covers it):

- ``hub/export.json``: ``{"tensors": {"model/<name>": {"regions": [[Hub key, first element, Hub shape], ...]}}}``
  in model order (pipeline stages in order): the Hub tensors each entry becomes (``conversion/hub_keys.py``:
  renames, experts split per expert, tied copies with no region); a generic tensor that ``transformers`` converts
  on save otherwise lists ``{"converted": [[Hub key, shape, dtype], ...]}``, which the consolidation reads whole and
  converts with a meta-device model of ``hub/config.json`` (``conversion/offline_conversion.py``).
- ``hub/config.json`` / ``hub/generation_config.json``: the configs the Hub folder gets.

Each rank computes the regions of its own tensors at capture time (no collective); the agreement after the RNG /
trainer-state files brings them to rank 0.
"""
from __future__ import annotations

import json
import os

import torch

HUB_DIR = "hub"
EXPORT_FILE = "export.json"


def capture(inner, context, plan) -> dict:
    """``{"tensors": {dcp key: regions or converted}, "configs": (config, generation config) on global rank 0}``."""
    from ..conversion.hub_keys import generic_outputs, native_regions
    from ..conversion.model_export import hub_configs
    from ..utils.model_protocol import protocol_of

    aliases: dict[int, list[str]] = {}  # a tied tensor's names; DCP stores it under the first (named_parameters')
    state = inner.state_dict(keep_vars=True)
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(name)
    tensors = {}
    placements = protocol_of(inner).layout == "placements"  # DTensors that say their own layout
    if placements:
        from ..conversion.export_pieces import generic_saved_state

        saved = generic_saved_state(inner)
        for names in aliases.values():
            kept = [name for name in names if name in saved]
            entry = {"regions": []}
            if kept:
                tensor = state[kept[0]]
                meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                kind, outputs = generic_outputs(inner, kept[0], meta)
                entry = ({"regions": [list(r) for r in outputs]} if kind == "regions" else
                         {"converted": [[k, list(shape), str(d)] for k, shape, d in outputs]})
            tensors[f"model/{names[0]}"] = entry
    else:
        from ..pipeline.stage import tied_duplicates

        regions_of, duplicates = native_regions(inner), tied_duplicates(inner)
        params = {name for name, _ in inner.named_parameters(remove_duplicate=False)}
        for names in aliases.values():
            if names[0] in duplicates:  # a copy the lowest pipeline stage holding it stores
                continue
            shape = tuple(state[names[0]].shape)  # an FSDP2 DTensor's shape is the tensor-parallel piece's
            if names[0] in params:
                shape = plan.shard_spec(inner, names[0]).full_shape_of(shape, context)
            tensors[f"model/{names[0]}"] = {"regions": [list(r) for name in names for r in regions_of(name, shape)]}
    configs = hub_configs(inner, placements) if context.rank == 0 else None
    return {"tensors": tensors, "configs": configs}


def write(folder: str, maps: list[dict], configs) -> None:
    """Rank 0: ``folder/hub/`` from every rank's tensor maps (rank order) and the configs."""
    from ..utils.files import atomic_write_file

    merged = {}
    for tensors in maps:
        for key, value in (tensors or {}).items():
            merged.setdefault(key, value)
    hub = os.path.join(folder, HUB_DIR)
    os.makedirs(hub, exist_ok=True)
    text = json.dumps({"tensors": merged}, indent=1)
    atomic_write_file(os.path.join(hub, EXPORT_FILE), lambda handle: handle.write(text.encode("utf-8")))
    config, generation_config = configs
    config.save_pretrained(hub)
    if generation_config is not None:
        generation_config.save_pretrained(hub)
