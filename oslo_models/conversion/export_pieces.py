"""What one rank holds of each tensor a Hub export writes: boxes of the full tensor and views of its own memory.

For every tensor of the model's state dict (a tied copy once) an :class:`Entry` says its full shape and dtype, the
Hub tensors it becomes (``hub_keys``' regions, or for a *converted* generic tensor the outputs of ``transformers``'
conversion) and this rank's ``pieces``: ``(full_start, length, view)`` boxes whose ``view`` is this rank's memory
for that box, never a copy. The boxes come from

- native models: the plan's ``Layout`` (``boxes.layout_boxes``: its ``read_shard`` inverted, per split dim), then,
  under ZeRO-2/3 (FSDP2), cut to the dim-0 rows of the tensor-parallel piece this rank keeps (the DTensor's own
  offset, HSDP included: replicas of a shard give equal boxes). Pipeline stages list their own tensors; a tied copy
  also held by a lower stage is left to it.
- generic models: each parameter's DTensor placements (tensor parallel, FSDP2, both) through
  ``compute_local_shape_and_global_offset``; a packed parameter (``transformers``' strided shards) through the
  view that makes it a box (``generic/checkpoint.dcp_value``), split back per block.

Nothing here communicates; the data-parallel replicas of a box are resolved by the writer's plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .boxes import clip_rows, layout_boxes
from .hub_keys import Region, generic_outputs, native_regions
from .safetensors_files import dtype_name


@dataclass
class Entry:
    """One model tensor: ``name``, full ``shape``, safetensors ``dtype``, ``regions`` (Hub tensors as intervals)
    or ``converted`` (Hub outputs of a whole-tensor conversion), this rank's ``pieces`` and, for a converted
    tensor, ``whole()``: its full value (a collective over the tensor's mesh)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    regions: list[Region] = field(default_factory=list)
    converted: list[tuple[str, tuple[int, ...], str]] | None = None
    pieces: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]] = field(default_factory=list)
    whole: object = None

    def describe(self) -> dict:
        """What the plan needs from this rank (no tensor): picklable."""
        return {"name": self.name, "shape": self.shape, "dtype": self.dtype,
                "regions": [tuple(r) for r in self.regions], "converted": self.converted,
                "boxes": [(start, length) for start, length, _ in self.pieces]}


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(local tensor, first row, rows)`` of an FSDP2 DTensor over its dp mesh (dim 0 only)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape) or any(offset[1:]) or tuple(shape[1:]) != tuple(tensor.shape[1:]):
        raise NotImplementedError(f"a data-parallel shard with placements {tensor.placements} is not a block of "
                                  "dim-0 rows; the distributed saver expects FSDP2's Shard(0)")
    return local, int(offset[0]), int(shape[0])


def native_entries(model) -> list[Entry]:
    """This rank's entries of a native model (possibly an FSDP2 model or a pipeline stage)."""
    from ..pipeline.stage import tied_duplicates

    context, plan = model.parallel_context, model.parallel_plan
    regions_of = native_regions(model)
    skip = tied_duplicates(model)
    entries, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in skip or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        spec = plan.shard_spec(model, name)
        rank, size = spec.position(context)
        full_shape, boxes = layout_boxes(spec, tuple(tensor.shape), rank, size)
        local = tensor.detach()
        if hasattr(local, "to_local"):  # ZeRO-2/3: this rank keeps rows of the tensor-parallel piece
            local, first, rows = _local_rows(local)
            boxes = clip_rows(boxes, first, first + rows)
        entry = Entry(name, full_shape, dtype_name(local.dtype), regions=regions_of(name, full_shape))
        entry.pieces = [(box.full_start, box.length, local[box.local_index()]) for box in boxes]
        entries.append(entry)
    return entries


def _split_packed(view, start, length, dim: int, blocks: int, block_rows: int):
    """Boxes of the unflattened view ``[.., blocks, block_rows, ..]`` as boxes of the packed tensor."""
    out = []
    for b in range(length[dim]):
        piece = view.narrow(dim, b, 1).flatten(dim, dim + 1)
        row = (start[dim] + b) * block_rows + start[dim + 1]
        out.append((start[:dim] + (row,) + start[dim + 2:], length[:dim] + (length[dim + 1],) + length[dim + 2:],
                    piece))
    return out


def _dtensor_pieces(tensor: torch.Tensor, packed):
    """``[(full_start, length, view)]`` of a generic model's tensor (DTensor or plain)."""
    if not hasattr(tensor, "placements"):
        return [(tuple(0 for _ in tensor.shape), tuple(tensor.shape), tensor)]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from ..generic.checkpoint import dcp_value

    value = dcp_value(tensor, packed)
    local = value.to_local()
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(shape) != tuple(local.shape):
        raise NotImplementedError(f"placements {value.placements} of a {tuple(value.shape)} tensor give no box")
    start, length = tuple(int(o) for o in offset), tuple(int(n) for n in shape)
    if local.numel() == 0:
        return []
    if packed is None:
        return [(start, length, local)]
    dim, blocks = packed
    return _split_packed(local, start, length, dim, blocks, value.shape[dim + 1])


def generic_saved_state(model) -> dict[str, torch.Tensor]:
    """The tensors ``transformers``' ``save_pretrained`` writes, by name (tied copies and ``_keys_to_ignore_on_save``
    left out, as it does), before its key conversion."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict(keep_vars=True)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    metas: dict[int, torch.Tensor] = {}
    meta_state = {name: metas.setdefault(id(t), torch.empty(t.shape, dtype=t.dtype, device="meta"))
                  for name, t in state.items()}
    kept = remove_tied_weights_from_state_dict(dict(meta_state), model)
    return {name: tensor for name, tensor in state.items() if name in kept}


def generic_entries(model) -> list[Entry]:
    """This rank's entries of a generic (``transformers``) model, tied copies removed as ``transformers`` does."""
    from ..generic.checkpoint import packed_parameters

    state = generic_saved_state(model)
    packed = packed_parameters(model)
    entries = []
    for name in state:
        tensor = state[name].detach()
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        kind, outputs = generic_outputs(model, name, meta)
        entry = Entry(name, tuple(tensor.shape), dtype_name(tensor.dtype))
        if kind == "regions":
            entry.regions = outputs
            entry.pieces = _dtensor_pieces(tensor, packed.get(name))
        else:  # gathered whole on the ranks of its mesh when written; one of them converts and writes it
            entry.converted = [(key, shape, dtype_name(dtype)) for key, shape, dtype in outputs]
            entry.pieces = [(tuple(0 for _ in tensor.shape), tuple(tensor.shape), None)]
            entry.whole = (lambda t=tensor: t.full_tensor() if hasattr(t, "full_tensor") else t)
        entries.append(entry)
    return entries
