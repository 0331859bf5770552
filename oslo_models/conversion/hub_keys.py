"""Which Hub tensors a model tensor becomes on save, as flat intervals of it: the saver's key map, without data.

A model tensor (full, row-major) is written as one or more Hub tensors, each a contiguous interval of its elements
(``Region``: Hub key, first flat element, Hub shape):

- usually itself under its own name;
- renamed (GPT-NeoX's ``lm_head.`` -> ``embed_out.``: ``models/common/loading/renamed_keys.py``);
- one Hub tensor per expert and projection for stacked experts (``models/common/loading/expert_keys.py``: ``gate_up_proj
  [E, 2i, h]`` -> expert ``e``'s gate ``[i, h]`` at element ``e*2i*h``, its up at ``e*2i*h + i*h``);
- nothing, for a tied copy ``transformers`` does not write.

Native models: the two key mixins above are the only transforms their ``full_state_dict`` applies, and
:func:`native_regions` applies the same ones, innermost first (the tests compare it with ``to_per_expert`` on real
tensors); a model class that overrides ``full_state_dict`` otherwise is refused with its name. Generic models: what
``transformers``' ``save_pretrained`` does (``revert_weight_conversion``), run per tensor on the meta device: a
rename, or views that are flat intervals of the tensor (OLMoE's ``down_proj`` per expert), become regions; anything
else (a split that copies, a transpose) is a *converted* tensor: gathered whole on one rank and converted there
(:func:`generic_outputs`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Region(NamedTuple):
    key: str
    start: int  # flat element of the model tensor where the Hub tensor begins
    shape: tuple[int, ...]


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _per_expert(region: Region, layout) -> list[Region]:
    """``to_per_expert`` of one region (``models/common/loading/expert_keys.py``), as sub-intervals."""
    block, _, leaf = region.key.rpartition(".experts.")
    parts = layout.parts
    if not block or leaf not in parts:
        return [Region(layout.to_hub(region.key), region.start, region.shape)]
    names, shape = parts[leaf], region.shape
    if shape[1] % len(names):
        raise ValueError(f"{region.key}: dim 1 of {shape} does not hold {len(names)} equal projections {names}")
    rows, rest = shape[1] // len(names), _numel(shape[2:])
    hub_block, out = layout.to_hub(block), []
    for j, name in enumerate(names):  # to_per_expert's order: projection, then expert
        for e in range(shape[0]):
            out.append(Region(f"{hub_block}.experts.{layout.expert_prefix}{e}.{name}.weight",
                              region.start + (e * shape[1] + j * rows) * rest, (rows, *shape[2:])))
    return out


def native_regions(model):
    """``regions(name, full_shape) -> [Region]`` for a native model (see the module docstring)."""
    from ..models.common.loading.expert_keys import PerExpertCheckpoint
    from ..models.common.loading.renamed_keys import RenamedHubKeys, _rename
    from ..models.modeling_utils import OsloPreTrainedModel

    known = (PerExpertCheckpoint, RenamedHubKeys, OsloPreTrainedModel)
    for cls in type(model).__mro__:
        if "full_state_dict" in vars(cls) and cls not in known:
            raise NotImplementedError(f"{cls.__name__} overrides full_state_dict with its own key transform, which "
                                      "the distributed saver does not know: save with distributed=False")
    chain = [cls for cls in type(model).__mro__ if cls in (PerExpertCheckpoint, RenamedHubKeys)][::-1]
    skip = set(model._tied_keys_to_skip())

    def regions(name: str, full_shape) -> list[Region]:
        if name in skip:
            return []
        out = [Region(name, 0, tuple(full_shape))]
        for cls in chain:  # innermost mixin first, as full_state_dict's super() chain applies them
            if cls is PerExpertCheckpoint:
                out = [piece for region in out for piece in _per_expert(region, model.expert_key_layout)]
            else:
                out = [Region(_rename(r.key, model.hub_key_renames, to_module=False), r.start, r.shape)
                       for r in out]
        return out

    return regions


def _interval(view: torch.Tensor, source: torch.Tensor) -> int | None:
    """The flat start of ``view`` in ``source`` when it is a contiguous row-major view of it, else ``None``."""
    base = view._base if view._base is not None else view
    if view is source:
        return 0
    if base is not source and base is not source._base:
        return None
    if not view.is_contiguous():
        return None
    return view.storage_offset() - source.storage_offset()


def generic_outputs(model, name: str, meta: torch.Tensor):
    """``("regions", [Region])`` or ``("converted", [(hub key, shape, dtype)])`` for tensor ``name`` of a generic
    model (``meta``: a meta tensor of its full shape and dtype), from ``transformers``' own reverse conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, {name: meta})
    regions = []
    for key, value in out.items():
        value = value[0] if isinstance(value, list) else value
        start = _interval(value, meta)
        if start is None:
            return "converted", [(k, tuple((v[0] if isinstance(v, list) else v).shape),
                                  (v[0] if isinstance(v, list) else v).dtype) for k, v in out.items()]
        regions.append(Region(key, start, tuple(value.shape)))
    return "regions", regions


def convert_whole(model, name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Hub tensors of a converted tensor (its whole value on this rank), contiguous."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, {name: full})
    return {key: (value[0] if isinstance(value, list) else value).contiguous() for key, value in out.items()}
