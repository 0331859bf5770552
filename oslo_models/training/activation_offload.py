"""Activation offload to host memory (DeepSpeed ALST / torchtitan / TRL ``activation_offloading``): every tensor a
transformer block saves for its backward moves to host memory in the forward and comes back in the backward, through
``torch.autograd.graph.saved_tensors_hooks``. Nothing is recomputed: the device keeps no activations of the blocks
between forward and backward, the host holds them instead.

``ActivationOffload(min_bytes=...)`` is the hooks object (a context manager); ``ParallelConfig.activation_offload``
(``True`` or the ``min_bytes``) switches it on for every block of a native model
(``models/common/stack/long_sequence.py`` enters it around each block's forward in training, so the loss head and the
embeddings keep theirs).

What moves: saved tensors of at least ``min_bytes`` (default 1 MiB) that are not parameters or views of parameters
(those live anyway; copying them would only cost bandwidth).

On CUDA: each device -> host copy runs on a side stream (``torch.cuda.Stream``) after an event of the compute stream,
into a pinned buffer taken from a pool of freed buffers of the same size (pinning is slow; the pool keeps the
buffers of one step for the next); the device tensor is kept alive (``record_stream``) until its copy is done, so
the copies overlap the next layers' compute. The backward waits for that copy's event and copies back on the compute
stream (``non_blocking`` from pinned memory); the buffer returns to the pool when autograd frees the saved tensor,
and is reused only after its last copy back has finished. (The copies back are not prefetched ahead of the
backward: each waits for its layer. Untested on a GPU: none was lent when this was written.)

On CPU there is no other memory to move to: the hooks copy each tensor into a fresh host buffer and back, which
exercises the path exactly (bitwise: copies only) and saves nothing (peak RSS is the same or higher, by the copies
in flight). The memory saving is a GPU-only effect.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

DEFAULT_MIN_BYTES = 1 << 20


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


class _Offloaded:
    """A saved tensor on the host: ``host``, the ``device`` it came from, the side-stream ``event`` of its copy.
    On CUDA its pinned buffer returns to ``pool`` when autograd frees the saved tensor (after the backward that
    used it, or with the graph), behind the event of its last host -> device copy: a graph kept with
    ``retain_graph=True`` can unpack it again."""

    __slots__ = ("host", "device", "event", "pool", "last_read")

    def __init__(self, host, device, event, pool=None):
        self.host, self.device, self.event, self.pool, self.last_read = host, device, event, pool, event

    def __del__(self):
        if self.pool is not None:
            self.pool[(tuple(self.host.shape), self.host.dtype)].append((self.host, self.last_read))


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep activations of at least ``min_bytes`` in host memory (module docstring).
    ``moved_bytes``: the bytes packed so far (a counter for tests and benchmarks)."""

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES):
        self.min_bytes = int(min_bytes)
        self.moved_bytes = 0
        self._stream = None
        self._pool: dict[tuple, list] = defaultdict(list)  # (shape, dtype) -> [(pinned buffer, ready event)]
        super().__init__(self._pack, self._unpack)

    # ------------------------------------------------------------------ hooks
    def _pack(self, tensor: torch.Tensor):
        if (tensor.layout != torch.strided or _is_parameter(tensor)
                or tensor.numel() * tensor.element_size() < self.min_bytes):
            return tensor
        self.moved_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type == "cuda":
            return self._pack_cuda(tensor)
        host = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        host.copy_(tensor)
        return _Offloaded(host, tensor.device, None)

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.device.type != "cuda":
            return packed.host  # CPU: the copy is the saved tensor
        compute = torch.cuda.current_stream(packed.device)
        compute.wait_event(packed.event)  # the device -> host copy is done
        restored = packed.host.to(packed.device, non_blocking=True)
        packed.last_read = compute.record_event()  # the buffer is reused only after this copy has read it
        return restored

    # ------------------------------------------------------------------ CUDA
    def _pack_cuda(self, tensor: torch.Tensor) -> _Offloaded:
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        host = self._buffer(tensor)
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
            event = self._stream.record_event()
        tensor.record_stream(self._stream)  # its memory is not reused before the copy has read it
        return _Offloaded(host, tensor.device, event, self._pool)

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        free = self._pool.get((tuple(tensor.shape), tensor.dtype))
        if free:
            host, ready = free.pop()
            ready.synchronize()  # its last host -> device copy has finished reading it
            return host
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)


def check_setting(setting) -> int | None:
    """``ParallelConfig.activation_offload`` -> ``min_bytes`` (``None``: off). ``True``: the default threshold;
    an int >= 0: that threshold in bytes. ``ValueError`` otherwise."""
    if setting is None or setting is False:
        return None
    if setting is True:  # (``0 == False``: compared by identity, so 0 is a threshold)
        return DEFAULT_MIN_BYTES
    if isinstance(setting, int) and setting >= 0:
        return setting
    raise ValueError(f"ParallelConfig.activation_offload must be False/None, True or a byte threshold (int >= 0), "
                     f"got {setting!r}")
