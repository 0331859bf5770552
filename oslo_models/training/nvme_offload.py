"""Optimizer state on local disk (ZeRO-Infinity's NVMe tier): ``ParallelConfig(offload="nvme", offload_path=...)``.

:class:`DiskOffloadedOptimizer` is ``torch.optim.Adam``/``AdamW`` whose moments (``exp_avg``, ``exp_avg_sq``, and
``max_exp_avg_sq`` with amsgrad) live in one scratch file per rank, ``<offload_path>/rank<N>/adam_state.bin``,
instead of host or device memory. Only the per-parameter ``step`` counters (0-dim tensors) stay in memory.

File layout: the parameters of the optimizer's param groups, in order; each parameter's *local* tensor (a plain
tensor, a tensor-parallel shard, or the local chunk of an FSDP2 ``DTensor`` under ZeRO-2/3) owns ``K`` consecutive
regions of ``numel * element_size`` bytes (``K`` = 2, 3 with amsgrad), in the parameter's dtype (what
``torch.optim.Adam`` keeps: no fp32 master copy is made, the project trains fp32 parameters under autocast). A new
file is sparse zeros: the state of a parameter that never stepped is ``zeros_like``, as Adam's lazy init.

The step walks *chunks* (consecutive parameters of one param group, up to ``chunk_bytes`` of state) with a
background I/O thread: while chunk ``k`` is updated, chunk ``k - 1`` is written back (``os.pwritev``) and then chunk
``k + 1`` read (``os.preadv``; both release the GIL) into the other of two buffers of the largest chunk's size,
allocated once (a parameter larger than ``chunk_bytes`` is a chunk of its own). Each chunk is updated by
torch's own functional ``torch.optim.adam.adam`` with the group's hyperparameters on the local tensors: the same
arithmetic as the in-memory optimizer, bit for bit. No collective runs in the step (the parameters and gradients
are local shards; FSDP2 reduce-scattered the gradients already).

``state`` is a mapping with the torch optimizer interface (``opt.state[p]``: ``{"step", "exp_avg", ...}``) that
resumable checkpoints read and write (``training/checkpoint.py``): reads are zero-copy views of the file mapped
with ``MAP_SHARED`` (page cache the kernel can evict, never anonymous memory), ``DTensor`` s like their parameter
under FSDP2; writes go to the file. The scratch file is never the checkpoint: it is deleted on :meth:`close` (or
when the optimizer is collected) and a crash leaves only a stale lock that the next run takes over.

Errors before any collective (:func:`prepare_offload_folder`, run on every rank under ``all_or_none``): the path
is not a writable folder, the filesystem has less free space than the predicted state, or the rank folder is
locked by a live process (another job, or two ranks with one rank id on one node).
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import weakref
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor

import torch

STATE_FILE = "adam_state.bin"
LOCK_FILE = "owner.lock"
PARAM_FILE = "zero3_params.bin"  # nvme_params.py's file of ZeRO-3 parameter shards (offload_params=True)
DEFAULT_CHUNK_BYTES = 16 << 20


def _state_keys(amsgrad: bool) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a ``DTensor`` (FSDP2 shard, generic tp), the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def predicted_state_bytes(local_numels_and_sizes, amsgrad: bool = False) -> int:
    """Bytes of the state file: ``K`` regions per parameter of ``numel * element_size`` bytes."""
    return len(_state_keys(amsgrad)) * sum(n * size for n, size in local_numels_and_sizes)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _take_lock(lock: str) -> None:
    """Create ``lock`` with ``O_EXCL`` (``host pid``); a lock left by a dead process of this host is taken over."""
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(lock, encoding="utf-8") as handle:
                    host, _, pid = handle.read().strip().partition(" ")
            except OSError:
                host, pid = "", ""
            if host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid)):
                os.unlink(lock)  # stale: left by a crashed run on this host
                continue
            raise ValueError(f"offload folder {os.path.dirname(lock)} is in use by process {pid or '?'} on "
                             f"{host or '?'} (lock {lock}): two processes (another run, or two ranks with one rank "
                             f"id on one node) must not share it; give each run its own offload_path") from None
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(me)
        return
    raise ValueError(f"could not take the offload lock {lock}")


def prepare_offload_folder(offload_path: str, rank: int, needed_bytes: int, *, local_ranks: int = 1) -> str:
    """Create and lock ``<offload_path>/rank<rank>`` and check the space; returns the folder.

    ``ValueError`` when the path is not a writable folder, when the filesystem's free bytes are below
    ``needed_bytes * local_ranks`` (the ranks of this node write their files to the same disk), or when another
    live process holds the folder. Local only (no collective): callers agree on the outcome over the world."""
    root = os.path.abspath(os.fspath(offload_path))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"offload_path={offload_path!r} is not a folder")
    folder = os.path.join(root, f"rank{rank}")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise ValueError(f"offload_path={offload_path!r} is not writable: {error}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"offload_path={offload_path!r} is not writable (folder {folder})")
    free = shutil.disk_usage(folder).free
    need = needed_bytes * max(1, local_ranks)
    if free < need:
        raise ValueError(f"offload_path={offload_path!r} has {_gib(free)} free, the optimizer state offloaded to it "
                         f"needs {_gib(need)} ({_gib(needed_bytes)} per rank x {max(1, local_ranks)} rank(s) on this "
                         f"node); free space or choose another disk")
    try:
        _take_lock(os.path.join(folder, LOCK_FILE))
    except PermissionError as error:
        raise ValueError(f"offload_path={offload_path!r} is not writable: {error}") from None
    return folder


def release_offload_folder(folder: str) -> None:
    """Delete the scratch files (the parameters' too, ``nvme_params.py``: a mapping outlives its unlinked file), the
    lock and the (then empty) rank folder."""
    for name in (STATE_FILE, PARAM_FILE, LOCK_FILE):
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


def _cleanup(folder: str, pool: ThreadPoolExecutor, fd_box: list) -> None:
    """Finalizer: stop the I/O thread, close the file, release the folder (scratch, never the checkpoint)."""
    pool.shutdown(wait=True)
    if fd_box:
        os.close(fd_box.pop())
    release_offload_folder(folder)


class _DiskState(MutableMapping):
    """``optimizer.state`` backed by the file: ``state[p]`` is ``{"step": tensor, key: view of the file}``."""

    def __init__(self, owner: "DiskOffloadedOptimizer"):
        self._owner = weakref.proxy(owner)
        self.steps: dict[torch.Tensor, torch.Tensor] = {}

    def __getitem__(self, param):
        if param not in self.steps:
            return {}  # no state yet (like Adam's defaultdict before the first step)
        values = {"step": self.steps[param]}
        for key in self._owner.state_keys:
            values[key] = self._owner._file_view(param, key)
        return values

    def __setitem__(self, param, values):
        self._owner._write_state(param, values)

    def __delitem__(self, param):
        del self.steps[param]

    def __contains__(self, param):
        return param in self.steps

    def __iter__(self):
        return iter(list(self.steps))

    def __len__(self):
        return len(self.steps)


class DiskOffloadedOptimizer(torch.optim.Optimizer):
    """Adam / AdamW with its moments in ``folder/adam_state.bin`` (see the module docstring).

    Args:
        params: parameters or param groups (the same as the wrapped optimizer's; groups keep their keys).
        folder: this rank's locked folder (:func:`prepare_offload_folder`).
        defaults: the Adam/AdamW defaults (``optimizer.defaults``).
        chunk_bytes: state bytes per chunk of the step (two chunk buffers in memory).
    """

    def __init__(self, params, folder: str, defaults: dict, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__(params, dict(defaults))
        for group in self.param_groups:
            for key, value in (("capturable", False), ("differentiable", False)):
                if group.get(key, value) != value:
                    raise ValueError(f"offload='nvme' does not support Adam's {key}=True")
        amsgrad = {bool(group.get("amsgrad", False)) for group in self.param_groups}
        if len(amsgrad) > 1:
            raise ValueError("offload='nvme': param groups must agree on amsgrad (one file layout)")
        self.state_keys = _state_keys(amsgrad.pop() if amsgrad else False)
        self.folder, self.chunk_bytes = folder, int(chunk_bytes)
        self.state = _DiskState(self)
        self._offsets: dict[torch.Tensor, int] = {}  # param -> byte offset of its first region
        offset = 0
        for group in self.param_groups:
            for param in group["params"]:
                if param not in self._offsets:
                    self._offsets[param] = offset
                    offset += len(self.state_keys) * self._nbytes(param)
        self.file_bytes = offset
        path = os.path.join(folder, STATE_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, max(offset, 1))  # sparse zeros: Adam's zero init, disk blocks allocated as written
        self._fd_box = [fd]
        self._path, self._map = path, None  # the MAP_SHARED view of the file, made on first use (checkpoints)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-offload")
        self._finalizer = weakref.finalize(self, _cleanup, folder, self._pool, self._fd_box)
        self._lock = threading.Lock()
        self._ring = None  # the step's two chunk buffers (``_buffers``)
        self.after_chunk = None  # called with each updated chunk's parameters (nvme_params.ParameterFile.attach)

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, folder: str, **kwargs) -> "DiskOffloadedOptimizer":
        """The disk-backed twin of a fresh ``torch.optim.Adam``/``AdamW`` (same groups and hyperparameters)."""
        if not isinstance(optimizer, torch.optim.Adam) or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise ValueError(f"offload='nvme' offloads torch.optim.Adam / AdamW state; got {type(optimizer).__name__} "
                             "(use offload='cpu', or AdamW)")
        return cls([dict(group) for group in optimizer.param_groups], folder, optimizer.defaults, **kwargs)

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _nbytes(param) -> int:
        local = _local(param)
        return local.numel() * local.element_size()

    def _region(self, param, key: str) -> int:
        return self._offsets[param] + self.state_keys.index(key) * self._nbytes(param)

    def _file_view(self, param, key: str) -> torch.Tensor:
        """A zero-copy view of the file (``MAP_SHARED``): shaped like the local tensor, a DTensor like ``param``."""
        local = _local(param)
        start = self._region(param, key)
        if self._map is None:
            self._map = torch.UntypedStorage.from_file(self._path, shared=True, nbytes=max(self.file_bytes, 1))
        flat = torch.empty(0, dtype=torch.uint8)
        flat.set_(self._map, start, (self._nbytes(param),))
        view = flat.view(local.dtype).view(local.shape)
        if hasattr(param, "to_local"):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(view, param.device_mesh, param.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())
        return view

    def _write_state(self, param, values: dict) -> None:
        if param not in self._offsets:
            raise KeyError("not a parameter of this optimizer")
        step = values.get("step", 0.0)
        step = step.detach().clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
        # the group by identity: ``param in g["params"]`` would compare tensors with ``==`` (element-wise)
        if step.device.type != "cpu" and not any(g["fused"] for g in self.param_groups
                                                 if any(p is param for p in g["params"])):
            step = step.cpu()
        local = _local(param)
        for key in self.state_keys:
            value = values.get(key)
            data = (torch.zeros_like(local) if value is None
                    else _local(value).detach().to(device="cpu", dtype=local.dtype).reshape(local.shape))
            os.pwritev(self._fd_box[0], [data.contiguous().view(torch.uint8).numpy()], self._region(param, key))
        self.state.steps[param] = step

    # ------------------------------------------------------------------ the step
    def _chunks(self, group) -> list[list]:
        chunks, current, size = [], [], 0
        for param in group["params"]:
            need = len(self.state_keys) * self._nbytes(param)
            if current and size + need > self.chunk_bytes:
                chunks.append(current)
                current, size = [], 0
            current.append(param)
            size += need
        if current:
            chunks.append(current)
        return chunks

    def _chunk_bytes(self, params) -> int:
        return self._offsets[params[-1]] + len(self.state_keys) * self._nbytes(params[-1]) - self._offsets[params[0]]

    def _buffers(self) -> list[torch.Tensor]:
        """Two buffers of the largest chunk, allocated once (not per chunk: freed chunk-sized blocks would stay in
        the allocator's arenas and grow the resident memory step after step)."""
        if self._ring is None:
            largest = max((self._chunk_bytes(c) for g in self.param_groups for c in self._chunks(g)), default=0)
            self._ring = [torch.empty(largest, dtype=torch.uint8) for _ in range(2)]
        return self._ring

    def _read(self, params, buffer: torch.Tensor) -> torch.Tensor:
        """One contiguous read of the chunk's regions (parameters are consecutive in the file) into ``buffer``."""
        size = self._chunk_bytes(params)
        buffer = buffer[:size]
        if size:
            got = os.preadv(self._fd_box[0], [buffer.numpy()], self._offsets[params[0]])
            if got != size:
                raise OSError(f"short read of the offloaded optimizer state ({got} of {size} bytes)")
        return buffer

    def _write(self, params, buffer: torch.Tensor) -> None:
        if buffer.numel():
            os.pwritev(self._fd_box[0], [buffer.numpy()], self._offsets[params[0]])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._finalizer.alive:
            raise RuntimeError("this DiskOffloadedOptimizer is closed")
        with self._lock:
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _step_group(self, group) -> None:
        from torch.optim.adam import adam

        chunks = [c for c in self._chunks(group) if any(p.grad is not None for p in c)]
        # Double buffering with one FIFO I/O thread: chunk k is updated in ring[k % 2] while the thread writes chunk
        # k - 1 back from the other buffer and then reads chunk k + 1 into it (the FIFO orders the two).
        ring = self._buffers() if chunks else []
        pending_read = self._pool.submit(self._read, chunks[0], ring[0]) if chunks else None
        writes = []
        for index, chunk in enumerate(chunks):
            buffer = pending_read.result()
            if index + 1 < len(chunks):  # prefetch while this one runs
                pending_read = self._pool.submit(self._read, chunks[index + 1], ring[(index + 1) % 2])
            params, grads, states, steps = [], [], [[] for _ in self.state_keys], []
            start, has_complex = self._offsets[chunk[0]], False
            for param in chunk:
                if param.grad is None:
                    continue
                local = _local(param)
                if param.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                has_complex |= torch.is_complex(local)
                params.append(local)
                grads.append(_local(param.grad))
                for k, key in enumerate(self.state_keys):
                    begin = self._region(param, key) - start
                    region = buffer[begin:begin + self._nbytes(param)].view(local.dtype).view(local.shape)
                    states[k].append(region if local.device.type == "cpu" else region.to(local.device))
                if param not in self.state.steps:  # Adam's lazy init (the file region is zeros already)
                    self.state.steps[param] = (torch.zeros((), dtype=torch.float32, device=local.device)
                                               if group["fused"] else torch.tensor(0.0, dtype=torch.float32))
                steps.append(self.state.steps[param])
            beta1, beta2 = group["betas"]
            adam(params, grads, states[0], states[1], states[2] if len(states) > 2 else [], steps,
                 amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=group["foreach"], capturable=False, differentiable=False, fused=group["fused"],
                 grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                 decoupled_weight_decay=group.get("decoupled_weight_decay", False))
            if params and params[0].device.type != "cpu":  # device state: copy the moments back to the buffer
                self._copy_back(chunk, buffer, states, start)
            if self.after_chunk is not None:  # offload_params: the chunk's parameter pages leave the process
                self.after_chunk(chunk)
            writes.append(self._pool.submit(self._write, chunk, buffer))  # written while the next chunk runs
        for write in writes:
            write.result()

    def _copy_back(self, chunk, buffer, states, start) -> None:
        index = 0
        for param in chunk:
            if param.grad is None:
                continue
            local = _local(param)
            for k, key in enumerate(self.state_keys):
                begin = self._region(param, key) - start
                buffer[begin:begin + self._nbytes(param)].view(local.dtype).view(local.shape).copy_(states[k][index])
            index += 1

    # ------------------------------------------------------------------ state dict, close
    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict`` (casting, group checks), then the moments go to the file."""
        store = self.state
        super().load_state_dict(state_dict)  # replaces self.state with a plain dict
        loaded, self.state = self.state, store
        for param, values in loaded.items():
            if values:
                store[param] = values

    def close(self) -> None:
        """Delete the scratch file and the lock (also done when the optimizer is garbage collected)."""
        self._map = None
        self._finalizer()

    def __getstate__(self):
        raise TypeError("a DiskOffloadedOptimizer cannot be pickled (its state is a scratch file); checkpoint it "
                        "with oslo_models.training.save_checkpoint")
