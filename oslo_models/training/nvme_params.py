"""ZeRO-3 parameters on local disk (ZeRO-Infinity's parameter offload, DeepSpeed's ``offload_param.device=nvme``):
``ParallelConfig(zero_stage=3, offload="nvme", offload_params=True, offload_path=...)``.

Design: FSDP2 keeps each parameter's rank-local shard in one padded 1-D tensor (``FSDPParam._sharded_param_data``)
of which the parameter's ``DTensor`` local tensor is a view; the all-gather before each unit's forward and backward
reads it, the optimizer step writes it in place. :class:`ParameterFile` moves those tensors into one scratch file
per rank, ``<offload_path>/rank<N>/zero3_params.bin``, mapped ``MAP_SHARED`` (``torch.UntypedStorage.from_file``):
both tensors of every parameter are re-pointed (``Tensor.set_``) at the parameter's page-aligned region of the
mapping, so FSDP2, the optimizer and the checkpoints (DCP reads and loads the local tensors in place) work on the
file unchanged, bit for bit. Layout: the FSDP units in ``model.modules()`` order, each unit's parameters in FSDP's
order, each region ``padded shard numel * element_size`` bytes rounded up to a page.

Residency: pages of the mapping are file-backed page cache, never anonymous memory; a unit's pages are dropped from
this process (``madvise(MADV_DONTNEED)``: its RSS falls, the data stays in the page cache / file) after the unit's
forward (its all-gather has copied them), each optimizer chunk's as the disk optimizer's step finishes the chunk,
and every page after the step, so between steps no parameter shard is resident, during forward at most the unit
being gathered is and during the step one chunk's; the backward's re-gather faults each unit's shard in again and
it stays until the step (not dropped per unit in backward yet). The kernel writes dirty pages back and may evict clean
ones under memory pressure. No collective runs here. The file is scratch, never the checkpoint: deleted with the
optimizer's folder (``DiskOffloadedOptimizer.close``); the mapping outlives the unlinked file.

This relies on two FSDP2 attributes (``_sharded_param_data``, ``sharded_param._local_tensor``, torch 2.6+); a torch
without them is refused with a clear error rather than silently keeping the parameters in memory.
"""
from __future__ import annotations

import ctypes
import mmap
import os

import torch

from .nvme_offload import PARAM_FILE

_MADV_DONTNEED = 4  # linux/mman.h


def fsdp_units(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list]]:
    """``[(unit module, its FSDPParams)]`` of a ``fully_shard`` model, units in ``modules()`` order."""
    units = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = get_state()._fsdp_param_group if get_state is not None else None
        if group is not None and group.fsdp_params:
            units.append((module, list(group.fsdp_params)))
    return units


def _check_supported(fsdp_param) -> None:
    data = getattr(fsdp_param, "_sharded_param_data", None)
    local = getattr(getattr(fsdp_param, "sharded_param", None), "_local_tensor", None)
    if not isinstance(data, torch.Tensor) or not isinstance(local, torch.Tensor) or data.device.type != "cpu":
        raise NotImplementedError("offload_params=True needs FSDP2's sharded parameter buffers "
                                  "(FSDPParam._sharded_param_data, torch >= 2.6) on a CPU device; this torch or "
                                  "device does not provide them")
    if local.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
        raise NotImplementedError("offload_params=True: FSDP2's local parameter tensor is not a view of its "
                                  "sharded buffer in this torch version")


def _pages(fsdp_param) -> int:
    """Bytes of the parameter's region: its padded shard rounded up to whole pages."""
    data = fsdp_param._sharded_param_data
    return -(-data.numel() * data.element_size() // mmap.PAGESIZE) * mmap.PAGESIZE


class ParameterFile:
    """This rank's FSDP2 parameter shards in ``folder/zero3_params.bin`` (see the module docstring).

    Args:
        model: a model after ``fully_shard`` (ZeRO-3), before its first forward.
        folder: this rank's locked offload folder (``nvme_offload.prepare_offload_folder``).
    """

    def __init__(self, model: torch.nn.Module, folder: str):
        units = fsdp_units(model)
        if not units:
            raise ValueError("offload_params=True needs a ZeRO-3 (FSDP2) model; found no fully_shard unit")
        page = mmap.PAGESIZE
        layout, ranges, offset = [], [], 0
        for _, params in units:
            start = offset
            for fsdp_param in params:
                _check_supported(fsdp_param)
                layout.append((fsdp_param, offset))
                offset += _pages(fsdp_param)
            ranges.append((start, offset))
        # each parameter's pages, by the optimizer's parameter (the FSDP2 DTensor): dropped once the step updated it
        self._param_pages = {id(fsdp_param.sharded_param): (start, start + _pages(fsdp_param))
                             for fsdp_param, start in layout}
        self.path, self.nbytes = os.path.join(folder, PARAM_FILE), max(offset, page)
        self.storage = torch.UntypedStorage.from_file(self.path, shared=True, nbytes=self.nbytes)
        with torch.no_grad():
            for fsdp_param, start in layout:
                data, local = fsdp_param._sharded_param_data, fsdp_param.sharded_param._local_tensor
                element = data.element_size()
                if start % element:
                    raise AssertionError("page-aligned regions are element-aligned")
                region = torch.empty(0, dtype=data.dtype).set_(self.storage, start // element, data.shape,
                                                               data.stride())
                region.copy_(data)
                # both views of the shard move to the file: FSDP's all-gather input and the parameter's local tensor
                data.set_(self.storage, start // element, data.shape, data.stride())
                local.set_(self.storage, start // element, local.shape, local.stride())
        self._libc = ctypes.CDLL(None, use_errno=True)
        # after a unit's forward its all-gather has copied its shard: drop the unit's pages
        self._hooks = [module.register_forward_hook(lambda *_, span=span: self._drop(*span))
                       for (module, _), span in zip(units, ranges)]
        self.release()

    def _drop(self, start: int, end: int) -> None:
        if end <= start:
            return
        address = ctypes.c_void_p(self.storage.data_ptr() + start)
        if self._libc.madvise(address, ctypes.c_size_t(end - start), _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) on the parameter file failed")

    def release(self) -> None:
        """Drop every page of the file from this process (after the optimizer step that wrote them)."""
        self._drop(0, self.nbytes)

    def drop_params(self, params) -> None:
        """Drop the pages of ``params`` (optimizer parameters) from this process."""
        for param in params:
            span = self._param_pages.get(id(param))
            if span is not None:
                self._drop(*span)

    def attach(self, optimizer) -> None:
        """Drop each chunk's parameter pages as the disk optimizer's step finishes it (``after_chunk``), so the step
        holds one chunk's parameters at a time, and every page after the step."""
        optimizer.after_chunk = self.drop_params
        optimizer.register_step_post_hook(lambda *_: self.release())
        optimizer.parameter_file = self

    def resident_bytes(self) -> int:
        """Bytes of the file mapped into this process now (``Rss`` of its mapping in ``/proc/self/smaps``)."""
        total, inside = 0, False
        with open("/proc/self/smaps", encoding="utf-8") as smaps:
            for line in smaps:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):  # a mapping's header line
                    inside = line.rstrip().endswith(self.path)
                elif inside and first == "Rss:":
                    total += int(line.split()[1]) * 1024
        return total
