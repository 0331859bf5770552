"""Converted generic tensors without the trained model: ``transformers``' reverse weight conversion run offline.

A generic-path tensor that ``transformers`` converts on save by more than a rename or a slice (dots1's fused
``gate_up_proj [E, 2i, h]`` written per expert as ``gate_proj`` / ``up_proj``, a transpose, ...) is recorded in a
checkpoint's ``hub/export.json`` as ``{"converted": [[Hub key, shape, dtype], ...]}``. The consolidation reads such
a tensor whole on one process and converts it with a model built on the meta device from ``hub/config.json`` (the
class named in ``architectures``; no memory, no weights). Before anything is written, every process checks that
this conversion gives exactly the recorded keys, shapes and dtypes for every converted tensor (run on meta tensors):
a model whose live conversion differed (a legacy mapping attached at load) is refused with the way out, never
written under other names.
"""
from __future__ import annotations

import os

import torch


def torch_dtype(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` (as ``export.json`` records it) -> ``torch.bfloat16``."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the checkpoint's export record")
    return dtype


def meta_model(folder: str):
    """The ``transformers`` class of ``folder/hub/config.json``'s ``architectures``, built on the meta device."""
    import transformers

    from ..training.checkpoint_hub import HUB_DIR

    config = transformers.AutoConfig.from_pretrained(os.path.join(folder, HUB_DIR))
    names = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise ValueError(f"{folder}: its converted tensors need the model class, but hub/config.json names "
                         f"architectures={names or None}, which transformers does not have: load the checkpoint "
                         "and call training.save_pretrained")
    with torch.device("meta"):
        return cls(config)


def model_shape(model, key: str, entry) -> tuple[int, ...]:
    """The model tensor's shape of DCP entry ``key`` (stored as a row-major reshape of it: same elements)."""
    name = key.removeprefix("model/")
    tensor = model.state_dict().get(name)
    if tensor is None or tensor.numel() != entry.size.numel():
        raise ValueError(f"{key}: the model built from the saved config has "
                         f"{'no such tensor' if tensor is None else tuple(tensor.shape)}, the checkpoint stored "
                         f"{tuple(entry.size)}: load the checkpoint and call training.save_pretrained")
    return tuple(tensor.shape)


def check_conversions(model, converted: dict, metadata: dict) -> None:
    """Every converted entry (``{dcp key: [[Hub key, shape, dtype], ...]}``) converts, on meta tensors of the stored
    shape and dtype, to exactly its recorded outputs; ``ValueError`` naming the first that does not."""
    from .hub_keys import generic_outputs

    for key, recorded in converted.items():
        entry = metadata[key]
        meta = torch.empty(model_shape(model, key, entry), dtype=entry.properties.dtype, device="meta")
        kind, outputs = generic_outputs(model, key.removeprefix("model/"), meta)
        got = sorted((name, tuple(shape), dtype) for name, shape, dtype in outputs) if kind == "converted" else None
        want = sorted((name, tuple(shape), torch_dtype(dtype)) for name, shape, dtype in recorded)
        if got != want:
            raise ValueError(f"{key}: transformers' conversion of {type(model).__name__} built from the saved config "
                             f"gives {got if got is not None else kind}, the training run recorded {want}: "
                             "consolidate it by loading the checkpoint and calling training.save_pretrained")
