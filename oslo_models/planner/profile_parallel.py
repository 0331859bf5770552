"""``--profile`` inside a launched world: the real model's blocks timed WITH their process groups (issue 31).

``profile.Profiler`` times a block alone, at a tensor-parallel rank's local widths; the time model then adds each
axis's collectives from fitted link costs (``time.py``). On a device whose collectives share the cores, the
streams or the memory bandwidth with the math (gloo on CPU; small messages on any GPU), that sum misses what the
axis really costs: the contention between a collective and the kernels around it, the extra copies and
bookkeeping of sequence parallelism's gathers, of the ring attention, of DDP's buckets and FSDP2's unshard /
reshard. Where the world at hand can host an axis's group, this module times the real thing instead:

- ``model-parallel``: the family's real model built on a ``ParallelContext`` of ``tp`` (with or without sequence
  parallelism) and ``cp`` ranks (the rest of the world: data-parallel replicas running the same block at once,
  as they would in training), forward + backward with every tp / sp / cp collective the layers run (the ring
  attention's own kernels and passes included), no data-parallel wrapper;
- ``wrapped``: the same, wrapped for data parallelism by ``training.shard_data_parallel`` at the layout's ZeRO
  stage (DDP for ZeRO-0, DDP + ``ZeroRedundancyOptimizer`` for ZeRO-1, FSDP2 for ZeRO-2/3, HSDP shard size kept),
  so DDP's bucketed all-reduce or FSDP2's gathers and reduce-scatters run inside the timed backward as in training.

Each is timed as ``profile.py`` times a block: a 1-layer and a ``1 + _EXTRA``-layer model, runs interleaved, best of
``repeats``; the block is the difference over ``_EXTRA``, the one-layer model minus its block is the outside
(embedding, head, loss: with their vocab-parallel collectives). Every timed run starts at a barrier of the whole
world. The optimizer step (``torch.optim.AdamW``, sharded as the wrapper shards it: ZeRO-1's broadcasts, FSDP2's
DTensor shards) is timed after each backward the same way, per block and outside. ``time.py`` charges
``model-parallel - alone`` as the tp / sp / cp communication and ``wrapped - model-parallel`` as the data-parallel
communication, replacing the fitted-link terms of those axes, and takes the optimizer step as timed.

Which keys a world can time: ``tp x cp`` must divide the world (model-parallel), and ``tp x cp x dp`` must equal it
(wrapped: the wrapper's group is the layout's whole dp x cp group). Others are not timed (``None``): ``time.py`` then
falls back to the link model for them (e.g. planning 1024 ranks from one 8-GPU node: tp <= 8 is timed, the dp
traffic across nodes is modelled). Collective: every rank must ask for the same keys in the same order (the search
is deterministic, so ranks running the same plan do).
"""
from __future__ import annotations

import time as _time

import torch

from .profile import _EXTRA, _FULL  # the block: (a 1 + _EXTRA layer model - a 1-layer one) / _EXTRA, as there


def parallel_key(tp: int, sp: bool, cp: int, seq: int, micro_batch: int, checkpointing: str | None,
                 wrapper: tuple[int, int] | None = None) -> str:
    """``seq``: the local sequence (``seq_len / cp``); ``wrapper``: ``(zero stage, dp x cp)`` or ``None`` (the
    model-parallel groups only)."""
    text = f"tp{tp}{'+sp' if sp and tp > 1 else ''} cp{cp} s{seq} b{micro_batch} ac{_FULL[checkpointing]}"
    if wrapper is not None:
        stage, dp = wrapper
        text += f" z{stage}x{dp}"
    return text


class ParallelRuns:
    """The runs with process groups of one ``Profiler`` (module docstring). ``profiler.parallel`` gets the derived
    ``[block, outside, optimizer per block, optimizer outside]`` seconds per ``parallel_key``."""

    def __init__(self, profiler):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("Profiler(groups=True) times blocks with process groups: launch a world first "
                             "(torchrun, then torch.distributed.init_process_group)")
        self.profiler, self.world = profiler, dist.get_world_size()
        self._contexts: dict = {}  # (tp, sp, cp, stage, shard) -> ParallelContext (its groups made once)
        self._models: dict = {}  # (tp, sp, cp, layers, mode, wrapper, shard) -> the (wrapped) model, its optimizer
        # key -> (arguments, best seconds [forward + backward of the 1-layer model, of the (1 + _EXTRA)-layer one,
        # optimizer step of the 1-layer model, of the (1 + _EXTRA)-layer one])
        self.runs: dict = {}

    def fits(self, tp: int, cp: int, wrapper) -> bool:
        if self.world % (tp * cp):
            return False
        return wrapper is None or (wrapper[1] > 1 and tp * wrapper[1] == self.world)

    def measure(self, tp, sp, cp, seq, micro_batch, checkpointing, wrapper, shard=None) -> tuple | None:
        """Time the key (collective) and record it; ``None`` when this world cannot host its groups."""
        if not self.fits(tp, cp, wrapper):
            return None
        key = parallel_key(tp, sp, cp, seq, micro_batch, checkpointing, wrapper)
        arguments = (tp, sp and tp > 1, cp, seq, micro_batch, checkpointing, wrapper, shard)
        self.runs[key] = (arguments, self._time(arguments, [float("inf")] * 4, self.profiler.repeats + 2, warm=2))
        return self.record(key)

    def record(self, key: str) -> tuple[float, ...]:
        _, (t1, t_more, o1, o_more) = self.runs[key]
        block = max(t_more - t1, 1e-9) / _EXTRA
        step = max(o_more - o1, 0.0) / _EXTRA
        self.profiler.parallel[key] = [block, max(t1 - block, 0.0), step, max(o1 - step, 0.0)]
        return tuple(self.profiler.parallel[key])

    def refine(self, rounds: int) -> None:
        for _ in range(rounds):
            for key, (arguments, best) in self.runs.items():
                self._time(arguments, best, 1, warm=0)
        for key in self.runs:
            self.record(key)

    # ------------------------------------------------------------------ building and timing
    def _context(self, tp, sp, cp, stage, shard):
        from ..config import ParallelConfig
        from ..distributed.context import ParallelContext

        key = (tp, sp, cp, stage, shard)
        if key not in self._contexts:
            config = ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp, context_parallel_size=cp,
                                    zero_stage=stage, data_parallel_shard_size=shard)
            self._contexts[key] = ParallelContext.from_config(config, device_type=self.profiler.device.type)
        return self._contexts[key]

    def _model(self, tp, sp, cp, layers, checkpointing, wrapper, shard):
        from ..training.zero import shard_data_parallel

        key = (tp, sp, cp, layers, checkpointing, wrapper, shard)
        if key not in self._models:
            context = self._context(tp, sp, cp, wrapper[0] if wrapper else 0, shard)
            torch.manual_seed(0)
            config = self.profiler._local_config(1, layers, 1 << 30)  # full widths: the layers shard themselves
            model = self.profiler.facts.model_class(config, parallel_context=context).to(context.device).train()
            if checkpointing:
                model.set_activation_checkpointing(checkpointing)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)  # tiny steps: the timed model barely moves
            if wrapper is not None:
                model, optimizer = shard_data_parallel(model, optimizer, zero_stage=wrapper[0])
            else:  # stepped only to time the step: replicas that drift apart change no timing (the guard's
                # question: who reduces the gradients)
                from ..distributed.data_parallel import mark_gradients_reduced

                mark_gradients_reduced(model, "the planner's profile (timing only)")
            self._models[key] = (model, optimizer)
        return self._models[key]

    def _batch(self, context, micro_batch, seq):
        from ..data import ContextParallelSplitter

        vocab = self.profiler.facts.vocab_size
        ids = torch.randint(1, vocab, (micro_batch, seq * context.cp_size),
                            generator=torch.Generator().manual_seed(1)).to(context.device)
        batch = {"input_ids": ids, "labels": ids}
        return ContextParallelSplitter(context, shift_labels=True)(batch) if context.cp_size > 1 else batch

    def _time(self, arguments, best: list, rounds: int, warm: int) -> list:
        import torch.distributed as dist

        tp, sp, cp, seq, micro_batch, checkpointing, wrapper, shard = arguments
        mode = _FULL[checkpointing]
        models = [self._model(tp, sp, cp, layers, mode, wrapper, shard) for layers in (1, 1 + _EXTRA)]
        batch = self._batch(self._context(tp, sp, cp, wrapper[0] if wrapper else 0, shard), micro_batch, seq)
        sync = self.profiler._sync
        for round_ in range(rounds):
            for i, (model, optimizer) in enumerate(models):
                dist.barrier()
                sync()
                start = _time.perf_counter()
                with self.profiler._autocast():
                    loss = model(**batch).loss
                loss.backward()
                sync()
                middle = _time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync()
                if round_ >= warm:
                    best[i] = min(best[i], middle - start)
                    best[2 + i] = min(best[2 + i], _time.perf_counter() - middle)
        return best
