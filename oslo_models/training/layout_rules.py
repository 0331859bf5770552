"""What the training wrappers refuse about a layout, decided from the options alone (no model, no process group).

``training.prepare`` and ``training.shard_data_parallel`` call :func:`check_training_layout` before they wrap
anything, and the composition table (``oslo_models/composition``) is generated from the same function, so a rule
written here is both enforced and documented.
"""
from __future__ import annotations

from ..config import ParallelConfig


def check_training_layout(parallel: ParallelConfig, *, zero_stage: int | None = None, cpu_offload: bool = False,
                          mixed_precision: str = "no", gradient_accumulation_steps: int = 1,
                          compiled: bool = False) -> None:
    """``ValueError`` / ``NotImplementedError`` for training options that do not fit ``parallel``.

    ``zero_stage``: ``None`` takes ``parallel.zero_stage``; ``mixed_precision``: ``"no"``, ``"bf16"`` or
    ``"fp16"`` (Accelerate's names); ``compiled``: the model is a ``torch.compile`` wrapper of the whole model."""
    stage = parallel.zero_stage if zero_stage is None else zero_stage
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be one of (0, 1, 2, 3), got {stage!r}")
    if cpu_offload and parallel.offload == "nvme":
        raise ValueError("cpu_offload=True and ParallelConfig.offload='nvme' choose two offload tiers; pick one "
                         "(offload='cpu' is cpu_offload=True)")
    if (cpu_offload or parallel.offload == "cpu") and stage < 2:
        raise ValueError(f"cpu_offload needs zero_stage 2 or 3 (FSDP2 offload), got zero_stage={stage}")
    pp = parallel.pipeline_parallel_size
    if parallel.offload == "nvme":
        # The disk tier replaces the local optimizer: ZeRO-1's partitioned optimizer (and with experts its split
        # optimizer) holds its state inside a wrapper the disk optimizer does not replace (yet). Experts at stages
        # 0/2/3 are fine: one plain optimizer over every local tensor (FSDP2 shards experts over edp), no collective
        # in its step.
        if parallel.offload_params and stage != 3:
            raise ValueError(f"offload_params=True offloads ZeRO-3's sharded parameters (DeepSpeed's offload_param "
                             f"needs stage 3 too); got zero_stage={stage}")
        if stage == 1:
            raise NotImplementedError("offload='nvme' with zero_stage=1 is not implemented (ZeroRedundancyOptimizer "
                                      "keeps its partition in memory); use zero_stage 2 or 3, which shard the "
                                      "optimizer state over dp too, or 0")
    if pp == 1:
        return
    if compiled:
        raise ValueError(compiled_pipeline_refusal())
    if gradient_accumulation_steps > 1:
        raise ValueError("gradient_accumulation_steps > 1 with pipeline_parallel_size > 1: the pipeline already "
                         "accumulates over its microbatches; raise ParallelConfig.num_microbatches (and the batch) "
                         "instead")
    # mixed_precision 'bf16' and 'fp16' both compose with pp: the stages autocast themselves and train_step scales
    # each microbatch's loss with the fp16 GradScaler (pipeline/runner.py)


def compiled_pipeline_refusal() -> str:
    """Why ``torch.compile`` of a whole pipelined model is refused (native and generic): it would compile nothing."""
    return ("torch.compile of a whole model with pipeline_parallel_size > 1: model.train_step runs each stage through "
            "the pipeline schedule, outside the compiled forward, so nothing would be compiled (the stages would run "
            "eagerly); compile the decoder layers this rank holds instead, before training.prepare (layer.compile() "
            "for each layer with parameters; tested at pp x cp and pp x ep)")
