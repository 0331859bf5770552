"""Asynchronous resumable checkpoints: ``save_checkpoint(..., async_=True)`` returns while the files are written.

The save is cut in two (``checkpoint.py``):

1. On the training thread, as for a synchronous save: the arrival check, the finite-weights check, the partial
   folder, and the capture of this rank's state (under ZeRO-2/3 the FSDP2 all-gathers run here, on the training
   process group, in step with the other ranks). The captured tensors are then *staged*: copied into host buffers
   by DCP's ``DefaultStager`` (pinned memory and non-blocking copies on CUDA), which keeps the buffers and reuses them
   for the next save; the trainer state and RNG state are deep-copied. Training resumes when staging is done.
2. On a background thread: ``dcp.save`` of the staged state, the RNG / trainer-state files, the checksums and the
   publication (rename, then ``latest``), exactly as the synchronous save writes them, so the checkpoint resumes at
   any layout the same way. Its collectives (DCP's plan exchange, the agreements) run on a process group of their
   own (gloo, made once per model on the first asynchronous save), never on the one training uses, so the two
   threads cannot interleave collectives differently on different ranks.

At most one save is in flight per model: the next ``save_checkpoint`` / ``load_checkpoint`` / ``wait_for_checkpoint``
joins it first (blocking only if it is still writing) and raises its failure there, the same agreed error on every
rank, never silently. A process killed while the thread writes leaves ``.step-N.partial`` unpublished and ``latest``
on the previous complete step. The writer object lives on the model instance (``training_state(model).async_writer``,
``utils/training_state.py``): nothing global.
Memory: one host copy of the rank's checkpointed state (model and optimizer), kept between saves.
"""
from __future__ import annotations

import copy
import threading
import time

import torch
import torch.distributed as dist

from ..utils.training_state import training_state, update_training_state


class AsyncWriter:
    """The background writer of one model's checkpoints (see the module docstring)."""

    def __init__(self, context):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.context = context
        distributed = dist.is_available() and dist.is_initialized() and context.world_size > 1
        self.group = dist.new_group(backend="gloo") if distributed else None  # collective: every rank
        cuda = torch.cuda.is_available() and context.device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: str | None = None
        # of the last save, seconds: waited (for the previous one), captured, staged (the call's blocking part);
        # write (the background part)
        self.timings: dict[str, float] = {}
        self._waited = 0.0

    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> str | None:
        """Join the save in flight; return its folder or raise its failure (once)."""
        if self._thread is None:
            self._waited = 0.0
            return None
        began = time.perf_counter()
        self._thread.join()
        self._waited = time.perf_counter() - began
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._result

    def start(self, path: str, step: int, captured: tuple, keep: int, write, *, capture_seconds: float = 0.0) -> str:
        """Stage ``captured`` (state, RNG state, trainer state) and write it in the background with ``write``
        (``checkpoint._write_step``). Returns the folder the step will have."""
        import os

        from .checkpoint_folders import remove_partial, step_dir_name

        assert self._thread is None, "wait() before starting another save"
        began = time.perf_counter()
        state, small = captured[0], copy.deepcopy(captured[1:])  # RNG, trainer state, Hub map: small, copied
        staged = self.stager.stage(state)
        self.stager.synchronize_staging()  # the copies are complete before training touches the tensors again
        self.timings = {"waited": self._waited, "captured": capture_seconds, "staged": time.perf_counter() - began}
        context, group = self.context, self.group

        def run():
            started = time.perf_counter()
            try:
                self._result = write(path, step, staged, *small, context=context, keep=keep, group=group)
            except BaseException as error:  # noqa: BLE001 - kept for wait(), which raises it
                self._error = error
                if context.is_main_process:
                    remove_partial(path, step)
            finally:
                self.timings["write"] = time.perf_counter() - started

        self._result = None
        self._thread = threading.Thread(target=run, name=f"oslo-checkpoint-step-{step}", daemon=True)
        self._thread.start()
        return os.path.join(path, step_dir_name(step))


def async_writer(model) -> AsyncWriter:
    """The model's background writer, made on first use (collective: every rank calls it)."""
    writer = training_state(model).async_writer
    if writer is None:
        writer = AsyncWriter(model.parallel_context)
        update_training_state(model, async_writer=writer)
    return writer
