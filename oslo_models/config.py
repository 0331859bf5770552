"""``ParallelConfig``: the one description of a parallel layout, validated when it is built.

The config is pure data: it knows nothing about the launched world. ``ParallelContext`` (``distributed/``)
combines it with the world size and infers ``data_parallel_size`` when it is left as ``None``.

Every dimension the project will have is a field now, so user code and saved configs do not change as features
land. Dimensions that are not implemented yet raise ``NotImplementedError`` naming the field when they are set to
anything but their trivial value: never a silent fallback to a different layout.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

TENSOR_PARALLEL_MODES = ("1d", "2d", "2.5d", "3d")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
CONTEXT_PARALLEL_MODES = ("ring", "all_to_all", "hybrid")
OFFLOAD_TIERS = (None, "cpu", "nvme")

_ZERO_STAGES = (0, 1, 2, 3)
_MAX_SEED = 2**63 - 1
_ACTIVATION_CHECKPOINTING = ("full", "selective", "offload", "partitioned")  # models/common/stack/checkpointing.py

# What is implemented today. Kept in one place so a feature landing is a one-line change here.
_IMPLEMENTED_TENSOR_PARALLEL_MODES = ("1d", "2d", "2.5d", "3d")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How a model is split over processes.

    World layout: ``world_size == pipeline_parallel_size * data_parallel_size * context_parallel_size *
    tensor_parallel_size``, with tensor-parallel ranks adjacent (they talk most), then context-parallel, then
    data-parallel, then pipeline (Megatron's order).
    Keyword-only: ``ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)`` (a positional argument raises
    ``TypeError``).
    Expert parallelism is carved out of the data-parallel ranks, so it must divide ``data_parallel_size``.

    Args:
        tensor_parallel_size: ranks that split each weight matrix.
        tensor_parallel_mode: ``"1d"`` (Megatron column/row), ``"2d"`` (Optimus/SUMMA on a q x q grid,
            ``tensor_parallel_size = q**2``), ``"2.5d"`` (Tesseract on q x q x d, ``tensor_parallel_size =
            q**2 * tensor_parallel_depth``), ``"3d"`` (Bian et al., q x q x q, ``tensor_parallel_size = q**3``).
            See ``grid_shape``.
        tensor_parallel_depth: depth ``d`` of the 2.5D mode (must be 1 for the other modes).
        sequence_parallel: Megatron sequence parallelism: activations outside the tensor-parallel regions
            (norms, dropout, residuals) are split along the sequence over the tensor-parallel group.
        pipeline_parallel_size: pipeline stages.
        pipeline_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zero_bubble"``.
        num_microbatches: microbatches per step for the pipeline (``None``: the number of stages).
        virtual_pipeline_size: model chunks per stage for the interleaved schedule.
        pipeline_partition: how layers are cut into stages: ``"uniform"`` (equal counts; ``ValueError`` when they
            do not divide), ``"parameters"`` (balanced parameter counts, embeddings and head included) or a tuple
            of layers per stage (``pipeline_parallel_size * virtual_pipeline_size`` entries).
        expert_parallel_size: ranks that split the experts of a mixture-of-experts layer, carved out of the
            data-parallel x context-parallel ranks (it must divide ``data_parallel_size * context_parallel_size``;
            the model checks that it divides the number of experts). Expert gradients are summed over the
            ``dp * cp / expert_parallel_size`` expert-data-parallel ranks and divided by ``dp * cp``, everything
            else averaged over dp x cp.
        expert_tensor_parallel_size: ranks that split each expert's feed-forward (Megatron-Core's
            ``expert_tensor_parallel_size``): gate/up column-parallel, down row-parallel, partial outputs summed
            over the ``k`` ranks. The expert mesh, over the same ranks as ``pp * dp * cp * tp``, is
            ``pp * edp * ep * etp`` with ``etp`` innermost: the ``etp`` group is ``k`` consecutive tensor-parallel
            ranks (``k`` must divide ``tensor_parallel_size``; ``k = tp`` is Megatron's default layout, where the
            tensor-parallel group splits the experts too), ``ep`` is carved out of ``dp`` (above) and ``edp = dp /
            ep``. With ``k < tp`` the ``tp / k`` sub-groups of a tensor-parallel group hold the same expert shards.
            ``k = 1`` (default): experts whole on every tensor-parallel rank.
        context_parallel_size: ranks that split every sequence into chunks and share the model like data-parallel
            ranks (their gradients are reduced together with dp: over dp x cp). World layout with it:
            ``pp * dp * cp * tp``, tensor-parallel ranks innermost (``parallel_layers/context_parallel``).
        context_parallel_mode: ``"ring"`` (key/value blocks passed around the cp ring, online-softmax merge; each
            rank holds the mirrored chunks ``i`` and ``2cp-1-i`` so causal work is balanced: sequence length
            divisible by ``2 * cp``) or ``"all_to_all"`` (Ulysses: heads <-> sequence exchange around the attention
            core; each rank holds one contiguous chunk, sequence length divisible by ``cp``, heads per tensor-
            parallel rank divisible by ``cp``) or ``"hybrid"`` (all-to-all inside groups of
            ``context_parallel_all_to_all_size`` consecutive cp ranks, e.g. a node, ring across the groups; the ring's
            chunk layout, heads per tensor-parallel rank divisible by the group size).
        context_parallel_all_to_all_size: the all-to-all group of ``context_parallel_mode="hybrid"`` (a divisor of
            ``context_parallel_size``, 1 < it < cp); ``None`` for the other modes.
        data_parallel_size: model replicas; ``None`` infers it from the world size.
        data_parallel_shard_size: HSDP (hybrid sharding): ZeRO-2/3 shards over groups of this many adjacent
            data-parallel ranks and replicates across the groups (FSDP2 on a 2D ``(replicate, shard)`` dp mesh:
            all-gathers and reduce-scatters stay inside a group, one all-reduce of the gradient shards runs across
            groups). ``None``: shard over all of dp. Must divide ``data_parallel_size``; needs ``zero_stage`` 2 or 3
            (ZeRO-1's optimizer partition is always over the whole dp group).
        zero_stage: ZeRO stage (0 = plain data parallel) for the training helpers.
        fused_ops: use the fused Triton kernels where they run (CUDA); the torch reference runs elsewhere.
        seed: base seed of the tensor-parallel RNG tracker (dropout inside split regions).
        activation_checkpointing: ``None`` (off), ``"full"`` (every block recomputed), ``"selective"`` (the
            attention core only), ``"offload"`` (full, block inputs kept in host memory) or ``"partitioned"`` (full,
            each TP rank keeps ``1/tp`` of a block's input). See ``models/common/stack/checkpointing.py``.
        collective_timeout: seconds a rank may wait in one collective (all-reduce, all-gather, send/recv, barrier)
            for a peer that stopped participating (hung, stopped, dead) before it fails with an error naming the
            group, the operation and the missing rank(s) (``distributed/watchdog.py``). Default 600 (10 minutes,
            NCCL's own default; gloo's is 30). ``None`` leaves the backend's timeouts alone and starts no watchdog.
        offload: where the training helpers keep what does not fit the device: ``None``; ``"cpu"`` (FSDP2
            ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state in host memory, ``zero_stage``
            2/3; the same as ``prepare(..., cpu_offload=True)``); ``"nvme"`` (ZeRO-Infinity's disk tier: the Adam
            state in one scratch file per rank under ``offload_path``, ``training/nvme_offload.py``).
        offload_path: the folder (on a local NVMe disk) for ``offload="nvme"``; each rank uses ``rank<N>/`` in it.
        block_plan: per-block data parallelism (OSDP / Galvatron; ``block_plan.py``): one entry per transformer
            block, ``{"shard": bool, "reshard_after_forward": bool, "checkpoint": bool}``; with ``zero_stage=3``
            only (the FSDP2 engine then shards or replicates each block as the plan says). ``None``: uniform.
        offload_params: with ``offload="nvme"`` and ``zero_stage=3``, the sharded parameters live in a scratch file
            there too (DeepSpeed's ``offload_param.device=nvme``; ``training/nvme_params.py``).
        tiled_mlp: long sequences: every decoder block's feed-forward in this many sequence slices (or ``"auto"``:
            ``ceil(s / h)``), each recomputed in the backward, so no ``[b, s, ffn]`` tensor is whole (ALST's
            TiledMLP; ``parallel_layers/tiled_mlp.py``). ``None``: off.
        activation_offload: long sequences: what every block saves for its backward lives in host memory (side-
            stream copies into pinned buffers on CUDA; on CPU a copy that saves nothing); ``True`` or the smallest
            tensor in bytes to move (``training/activation_offload.py``). Not with ``activation_checkpointing``
            (``"offload"`` is its checkpointed form).
        tiled_loss: long sequences: a causal LM's loss in training (labels given, ``model.training``) runs the LM
            head and the cross-entropy fused, in row chunks (``skip_logits=True`` on every such forward:
            ``fused_ops/fused_linear_cross_entropy.py``), so no ``[b, s, vocab]`` logits exist; the output's
            ``logits`` are then ``None`` (evaluation and generation keep them). Under pipeline parallelism the
            last stage of a stack causal LM sends its final hidden states to the schedule's loss, which runs the
            head and the cross-entropy in row chunks (``pipeline/adapter.py``, ``CausalLMPipelineAdapter``; 1D
            tensor parallelism only).
    """

    tensor_parallel_size: int = 1
    tensor_parallel_mode: str = "1d"
    tensor_parallel_depth: int = 1
    sequence_parallel: bool = False
    pipeline_parallel_size: int = 1
    pipeline_schedule: str = "1f1b"
    num_microbatches: int | None = None
    virtual_pipeline_size: int = 1
    pipeline_partition: str | tuple[int, ...] = "uniform"
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    context_parallel_mode: str = "ring"
    context_parallel_all_to_all_size: int | None = None
    data_parallel_size: int | None = None
    data_parallel_shard_size: int | None = None
    zero_stage: int = 0
    fused_ops: bool = True
    seed: int = 1234
    activation_checkpointing: str | None = None
    collective_timeout: float | None = 600.0
    offload: str | None = None
    offload_path: str | None = None
    block_plan: tuple | None = None
    offload_params: bool = False
    tiled_mlp: int | str | None = None
    activation_offload: bool | int = False
    tiled_loss: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "tensor_parallel_depth", "pipeline_parallel_size",
                     "virtual_pipeline_size", "expert_parallel_size", "context_parallel_size"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_microbatches", "data_parallel_size", "data_parallel_shard_size"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in ("sequence_parallel", "fused_ops"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ParallelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.tensor_parallel_mode not in TENSOR_PARALLEL_MODES:
            raise ValueError(f"ParallelConfig.tensor_parallel_mode={self.tensor_parallel_mode!r} is unknown; "
                             f"choose one of {TENSOR_PARALLEL_MODES}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"ParallelConfig.pipeline_schedule={self.pipeline_schedule!r} is unknown; "
                             f"choose one of {PIPELINE_SCHEDULES}")
        if self.context_parallel_mode not in CONTEXT_PARALLEL_MODES:
            raise ValueError(f"ParallelConfig.context_parallel_mode={self.context_parallel_mode!r} is unknown; "
                             f"choose one of {CONTEXT_PARALLEL_MODES}")
        self._check_hybrid_context_parallel()
        self._check_pipeline()
        self._check_tensor_parallel_mode()
        stage = self.zero_stage
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in _ZERO_STAGES:
            raise ValueError(f"ParallelConfig.zero_stage must be the int 0, 1, 2 or 3, got {self.zero_stage!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= _MAX_SEED:
            # The RNG tracker derives per-rank seeds by adding small offsets; torch takes seeds below 2**64.
            raise ValueError(f"ParallelConfig.seed must be an int in [0, 2**63 - 1], got {self.seed!r}")
        if (self.data_parallel_size is not None and self.expert_parallel_size > 1
                and self.data_parallel_size * self.context_parallel_size % self.expert_parallel_size):
            raise ValueError(f"expert_parallel_size={self.expert_parallel_size} must divide data_parallel_size="
                             f"{self.data_parallel_size} x context_parallel_size={self.context_parallel_size}")
        timeout = self.collective_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < float("inf")):
            raise ValueError(f"ParallelConfig.collective_timeout must be a positive number of seconds or None, "
                             f"got {timeout!r}")
        self._check_offload()
        from .block_plan import check_block_plan_layout, normalize_block_plan

        object.__setattr__(self, "block_plan", normalize_block_plan(self.block_plan))
        self._check_expert_tensor_parallel()
        self._check_implemented()
        self._check_hybrid_sharding()
        if self.activation_checkpointing is not None and self.activation_checkpointing not in _ACTIVATION_CHECKPOINTING:
            raise ValueError(f"ParallelConfig.activation_checkpointing={self.activation_checkpointing!r} is unknown; "
                             f"choose None or one of {_ACTIVATION_CHECKPOINTING}")
        check_block_plan_layout(self)
        self._check_long_sequence()

    def _check_long_sequence(self) -> None:
        from .parallel_layers.tiled_mlp import check_tiles_setting
        from .training.activation_offload import check_setting

        check_tiles_setting(self.tiled_mlp)
        if not isinstance(self.tiled_loss, bool):
            raise ValueError(f"ParallelConfig.tiled_loss must be a bool, got {self.tiled_loss!r}")
        if self.tiled_loss and self.pipeline_parallel_size > 1 and self.tensor_parallel_mode != "1d":
            raise NotImplementedError(f"ParallelConfig.tiled_loss with pipeline_parallel_size > 1 and "
                                      f"tensor_parallel_mode={self.tensor_parallel_mode!r} is not implemented (the "
                                      "grid heads' chunked loss under a pipeline is untested); use "
                                      "tensor_parallel_mode='1d' or tiled_loss=False")
        if check_setting(self.activation_offload) is not None and self.activation_checkpointing is not None:
            raise ValueError(f"ParallelConfig.activation_offload with activation_checkpointing="
                             f"{self.activation_checkpointing!r}: a checkpointed block saves only its input; "
                             "activation_checkpointing='offload' keeps that input in host memory")

    def _check_offload(self) -> None:
        """``offload`` in ``OFFLOAD_TIERS``; ``offload_path`` exactly when it is ``"nvme"`` (the ZeRO stage it needs
        is checked by ``training.layout_rules``: ``prepare`` may override ``zero_stage``)."""
        if self.offload not in OFFLOAD_TIERS:
            raise ValueError(f"ParallelConfig.offload={self.offload!r} is unknown; choose one of {OFFLOAD_TIERS}")
        path = self.offload_path
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
            object.__setattr__(self, "offload_path", path)
        if self.offload == "nvme" and (not isinstance(path, str) or not path):
            raise ValueError(f"ParallelConfig.offload='nvme' needs offload_path, the folder (on a local disk) for the "
                             f"offloaded optimizer state; got offload_path={path!r}")
        if self.offload_params not in (True, False):
            raise ValueError(f"ParallelConfig.offload_params must be a bool, got {self.offload_params!r}")
        if self.offload_params and self.offload != "nvme":
            raise ValueError(f"ParallelConfig.offload_params=True puts ZeRO-3 parameters on disk and needs "
                             f"offload='nvme' (with offload_path), got offload={self.offload!r}")
        if self.offload != "nvme" and path is not None:
            raise ValueError(f"ParallelConfig.offload_path={path!r} is only used by offload='nvme', got "
                             f"offload={self.offload!r}")

    def _check_hybrid_context_parallel(self) -> None:
        """``context_parallel_mode="hybrid"`` needs ``context_parallel_all_to_all_size``: a proper divisor > 1 of cp."""
        size, cp = self.context_parallel_all_to_all_size, self.context_parallel_size
        if self.context_parallel_mode != "hybrid":
            if size is not None:
                raise ValueError(f"ParallelConfig.context_parallel_all_to_all_size={size} is only used by "
                                 f"context_parallel_mode='hybrid', got {self.context_parallel_mode!r}")
            return
        if isinstance(size, bool) or not isinstance(size, int) or not 1 < size < cp or cp % size:
            raise ValueError(f"context_parallel_mode='hybrid' needs context_parallel_all_to_all_size, a divisor of "
                             f"context_parallel_size={cp} between 2 and {cp // 2} (all-to-all inside groups of that "
                             f"many cp ranks, ring across the groups), got {size!r}")

    def _check_implemented(self) -> None:
        if self.tensor_parallel_mode not in _IMPLEMENTED_TENSOR_PARALLEL_MODES:
            raise NotImplementedError(f"tensor_parallel_mode={self.tensor_parallel_mode!r} is not implemented yet; "
                                      f"available: {_IMPLEMENTED_TENSOR_PARALLEL_MODES}")
        # pipeline stages and the 2D / 2.5D / 3D grids run on the local chunk like the 1D layers do; experts are
        # carved out of dp x cp (distributed/context.py), their gradients summed over edp and divided by dp x cp
        # (the pipeline runner too, so cp x ep x pp runs)

    # ------------------------------------------------------------------ HSDP (data_parallel_shard_size)
    def _check_hybrid_sharding(self) -> None:
        """``data_parallel_shard_size``: a divisor of dp, for ZeRO-2/3 only (the model-free part; the world-size
        part is in ``resolve_data_parallel_size``)."""
        shard = self.data_parallel_shard_size
        if shard is None:
            return
        if self.zero_stage < 2:
            raise ValueError(f"data_parallel_shard_size={shard} (HSDP) shards parameters/gradients with FSDP2: it "
                             f"needs zero_stage 2 or 3, got zero_stage={self.zero_stage} (ZeRO-1 partitions the "
                             "optimizer state over the whole data-parallel group)")
        if self.data_parallel_size is not None and self.data_parallel_size % shard:
            raise ValueError(f"data_parallel_shard_size={shard} must divide data_parallel_size="
                             f"{self.data_parallel_size} (shard groups of {shard} replicas)")
        if shard > 1 and self.context_parallel_size > 1:
            raise NotImplementedError("data_parallel_shard_size with context_parallel_size > 1 is not implemented "
                                      "yet (the shard groups would span dp x cp); shard over all of dp x cp instead")
        if shard > 1 and self.expert_parallel_size > 1:
            raise NotImplementedError("data_parallel_shard_size with expert_parallel_size > 1 is not implemented "
                                      "yet (experts shard over the expert-data-parallel group)")

    # ------------------------------------------------------------------ expert tensor parallelism (own block)
    def _check_expert_tensor_parallel(self) -> None:
        """``expert_tensor_parallel_size`` is a positive divisor of ``tensor_parallel_size`` (its group is ``k``
        consecutive tensor-parallel ranks), 1D tensor parallelism only."""
        k = self.expert_tensor_parallel_size
        _check_positive_int("expert_tensor_parallel_size", k)
        if k == 1:
            return
        if self.tensor_parallel_mode != "1d":
            raise NotImplementedError(f"expert_tensor_parallel_size={k} with tensor_parallel_mode="
                                      f"{self.tensor_parallel_mode!r} is not implemented (under the grid the "
                                      "experts are whole on every rank); use tensor_parallel_mode='1d'")
        if self.tensor_parallel_size % k:
            raise ValueError(f"expert_tensor_parallel_size={k} must divide tensor_parallel_size="
                             f"{self.tensor_parallel_size} (its group is {k} consecutive tensor-parallel ranks)")

    def _check_tensor_parallel_mode(self) -> None:
        """The grid of the 2D/2.5D/3D modes must exist for ``tensor_parallel_size`` (see ``grid_shape``)."""
        mode, tp, depth = self.tensor_parallel_mode, self.tensor_parallel_size, self.tensor_parallel_depth
        if mode != "2.5d" and depth != 1:
            raise ValueError(f"tensor_parallel_depth={depth} is only used by tensor_parallel_mode='2.5d', "
                             f"got mode {mode!r}")
        if mode == "1d":
            return
        root = {"2d": 2, "2.5d": 2, "3d": 3}[mode]
        per_layer = tp // depth if tp % depth == 0 else 0
        q = round(per_layer ** (1 / root)) if per_layer else 0
        if not per_layer or q ** root != per_layer:
            need = {"2d": "a square (q*q: 1, 4, 9, 16, ...)", "3d": "a cube (q*q*q: 1, 8, 27, ...)",
                    "2.5d": f"q*q*tensor_parallel_depth (q*q*{depth}: {', '.join(str(n * n * depth) for n in (1, 2, 3))}, ...)"}
            raise ValueError(f"tensor_parallel_mode={mode!r} needs tensor_parallel_size to be {need[mode]}, "
                             f"got {tp}")
        if self.sequence_parallel:
            raise ValueError(f"sequence_parallel=True is a 1D (Megatron) feature: tensor_parallel_mode={mode!r} "
                             "already splits every activation over batch and hidden; drop sequence_parallel")
        if self.expert_parallel_size > 1:
            raise NotImplementedError(f"tensor_parallel_mode={mode!r} with expert_parallel_size > 1 is not "
                                      "implemented yet (under the grid every rank holds every expert and routes "
                                      "its batch block's tokens; the dispatch over ep is 1D only); use "
                                      "expert_parallel_size=1 or tensor_parallel_mode='1d'")

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """The tensor-parallel grid, outermost first: ``(tp,)`` for 1D, ``(q, q)`` for 2D, ``(d, q, q)`` for 2.5D,
        ``(q, q, q)`` for 3D. Its product is ``tensor_parallel_size``."""
        mode, tp, depth = self.tensor_parallel_mode, self.tensor_parallel_size, self.tensor_parallel_depth
        if mode == "1d":
            return (tp,)
        if mode == "3d":
            q = round(tp ** (1 / 3))
            return (q, q, q)
        q = round((tp // depth) ** 0.5)
        return (q, q) if mode == "2d" else (depth, q, q)

    def _check_pipeline(self) -> None:
        """Pipeline options that do not fit each other (the model-dependent checks run when it is split)."""
        partition = self.pipeline_partition
        if isinstance(partition, list):  # from JSON
            partition = tuple(partition)
            object.__setattr__(self, "pipeline_partition", partition)
        if isinstance(partition, tuple):
            if not partition or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in partition):
                raise ValueError(f"ParallelConfig.pipeline_partition must hold positive layer counts, got {partition!r}")
            if len(partition) != self.pipeline_parallel_size * self.virtual_pipeline_size:
                raise ValueError(f"ParallelConfig.pipeline_partition={partition} has {len(partition)} stage(s), but "
                                 f"pipeline_parallel_size x virtual_pipeline_size = "
                                 f"{self.pipeline_parallel_size * self.virtual_pipeline_size}")
        elif partition not in ("uniform", "parameters"):
            raise ValueError(f"ParallelConfig.pipeline_partition={partition!r} is unknown; use 'uniform', "
                             "'parameters' or a tuple of layers per stage")
        multi_stage = self.pipeline_schedule in ("interleaved_1f1b", "zero_bubble")
        if self.virtual_pipeline_size > 1 and not multi_stage:
            raise ValueError(f"virtual_pipeline_size={self.virtual_pipeline_size} needs pipeline_schedule="
                             f"'interleaved_1f1b' or 'zero_bubble', got {self.pipeline_schedule!r}")
        if self.pipeline_schedule == "interleaved_1f1b" and self.pipeline_parallel_size > 1 \
                and self.virtual_pipeline_size < 2:
            raise ValueError("pipeline_schedule='interleaved_1f1b' needs virtual_pipeline_size >= 2 (model chunks "
                             "per rank); use '1f1b' for one chunk per rank")
        pp, microbatches = self.pipeline_parallel_size, self.num_microbatches or self.pipeline_parallel_size
        if pp > 1 and self.pipeline_schedule == "1f1b" and microbatches < pp:
            raise ValueError(f"pipeline_schedule='1f1b' needs num_microbatches >= pipeline_parallel_size ({pp}), "
                             f"got {microbatches}; use more microbatches or 'gpipe'")
        if pp > 1 and multi_stage:
            rounds = max(1, microbatches // pp)
            if microbatches % rounds:
                raise ValueError(f"pipeline_schedule={self.pipeline_schedule!r} runs microbatches in rounds of "
                                 f"pipeline_parallel_size={pp}: num_microbatches={microbatches} must be a multiple "
                                 f"of {rounds} (or at most {pp})")

    # ------------------------------------------------------------------ sizes
    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model: tensor x pipeline (x context: cp ranks hold the same weights
        but train on different chunks of the same sequences, so they count as one replica)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    def resolve_data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` processes; ``ValueError`` when they do not fit (or when
        ``expert_parallel_size`` does not divide it)."""
        dp = self._resolve_data_parallel_size(world_size)
        if self.data_parallel_shard_size is not None and dp % self.data_parallel_shard_size:
            raise ValueError(f"data_parallel_shard_size={self.data_parallel_shard_size} must divide data_parallel_size="
                             f"{dp} (world {world_size} / (tensor x pipeline x context = {self.model_parallel_size}))")
        if dp * self.context_parallel_size % self.expert_parallel_size:
            raise ValueError(f"expert_parallel_size={self.expert_parallel_size} must divide data_parallel_size={dp} "
                             f"x context_parallel_size={self.context_parallel_size} (expert parallelism is carved out "
                             f"of the data- and context-parallel ranks: world {world_size} / (tensor x pipeline x "
                             f"context = {self.model_parallel_size})); launch a multiple of "
                             f"{self.model_parallel_size * self.expert_parallel_size} processes or lower it")
        return dp

    def _resolve_data_parallel_size(self, world_size: int) -> int:
        if self.data_parallel_size is not None:
            expected = self.model_parallel_size * self.data_parallel_size
            if expected != world_size:
                raise ValueError(
                    f"The launched world has {world_size} process(es), but the ParallelConfig asks for "
                    f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                    f"{self.pipeline_parallel_size} x context_parallel_size={self.context_parallel_size} x "
                    f"data_parallel_size={self.data_parallel_size} = {expected}. "
                    f"Launch {expected} processes (e.g. torchrun --nproc_per_node {expected}) or change the config.")
            return self.data_parallel_size
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"The launched world has {world_size} process(es), which tensor_parallel_size="
                f"{self.tensor_parallel_size} x pipeline_parallel_size={self.pipeline_parallel_size} x "
                f"context_parallel_size={self.context_parallel_size} = {self.model_parallel_size} does not divide. "
                f"Launch a multiple of {self.model_parallel_size} "
                f"processes (e.g. torchrun --nproc_per_node {self.model_parallel_size}).")
        return world_size // self.model_parallel_size

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ParallelConfig":
        """Build from a mapping; unknown keys raise ``ValueError`` (with the closest known name)."""
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = [key for key in values if key not in known]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"Unknown ParallelConfig option(s): {', '.join(hints)}. Known options: {known}")
        return cls(**dict(values))

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> "ParallelConfig":
        """Build from a JSON file path or a JSON string."""
        text, source = str(path_or_text), "the JSON text"
        if os.path.isfile(text):
            source = text
            with open(text, encoding="utf-8") as handle:
                text = handle.read()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            if source == "the JSON text" and not text.lstrip().startswith(("{", "[", '"')):
                raise FileNotFoundError(f"ParallelConfig.from_json: {text!r} is neither a file nor JSON text") from None
            raise ValueError(f"ParallelConfig.from_json: {source} is not valid JSON: {error}") from error
        if not isinstance(values, dict):
            raise ValueError(f"ParallelConfig.from_json: {source} must hold a JSON object of options "
                             f"({{\"tensor_parallel_size\": 2, ...}}), got a JSON {type(values).__name__}")
        return cls.from_dict(values)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
        return text


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}")
