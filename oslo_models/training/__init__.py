"""Training a parallel model with Accelerate or plain torch: data parallelism and ZeRO over the dp group only,
tensor-parallel-correct gradient clipping, mixed precision kept in step, resumable checkpoints at any layout.

    model, optimizer, loader, scheduler = om.training.prepare(accelerator, model, optimizer, loader, scheduler,
                                                              zero_stage=2)
    om.training.clip_grad_norm_(model, 1.0, accelerator=accelerator)
    om.training.save_checkpoint("ckpt", model, optimizer, scheduler, dataloader=loader, step=100)  # ckpt/step-00000100
    om.training.load_checkpoint("ckpt", model, optimizer, scheduler, dataloader=loader)  # the newest complete one
    om.training.check_finite(model, loss=loss, grad_norm=norm, step=step)  # NaN/inf on any rank: every rank raises
    trainer = om.training.Trainer(model=model, args=TrainingArguments(...), train_dataset=ds)  # transformers.Trainer

Checkpoints record checksums, verified before loading (``fallback=True``: the previous step when the newest is
corrupt); a save that fails on any rank (a full disk) fails on every rank and leaves ``latest`` where it was.
"""
from ..utils.training_state import TrainingState, training_state
from .checkpoint import load_checkpoint, save_checkpoint, wait_for_checkpoint
from .checkpoint_folders import find_checkpoint
from .checkpoint_integrity import CorruptCheckpointError, verify_checksums
from .clip import clip_grad_norm_, grad_norm
from .export import plain_copy, push_to_hub, save_pretrained, unsharded
from .finite import NonFiniteError, check_finite, describe_nonfinite, find_nonfinite
from .global_batch import GlobalBatchLoader, count_label_tokens, global_share
from .mixed_precision import check_mixed_precision, mark_overflow, sync_overflow
from .prepare import prepare
from .zero import ZERO_STAGES, shard_data_parallel, unwrap_model, unwrap_optimizer, zero_stage_of

__all__ = [
    "ZERO_STAGES", "check_mixed_precision", "clip_grad_norm_", "grad_norm", "load_checkpoint", "mark_overflow", "plain_copy",
    "prepare", "push_to_hub", "save_checkpoint", "save_pretrained", "unsharded", "shard_data_parallel", "sync_overflow", "unwrap_model", "unwrap_optimizer",
    "zero_stage_of", "TrainingState", "training_state",
    "find_checkpoint", "wait_for_checkpoint", "CorruptCheckpointError", "verify_checksums", "NonFiniteError", "check_finite",
    "describe_nonfinite", "find_nonfinite", "GlobalBatchLoader", "count_label_tokens", "global_share", "Trainer", "ParallelTrainerMixin", "DiskOffloadedOptimizer",
]


def __getattr__(name: str):
    # transformers.Trainer (and Accelerate behind it) is imported only when the Trainer integration is used
    if name in ("Trainer", "ParallelTrainerMixin"):
        from . import trainer

        return getattr(trainer, name)
    if name == "DiskOffloadedOptimizer":  # ParallelConfig(offload="nvme"): what prepare returns as the optimizer
        from .nvme_offload import DiskOffloadedOptimizer

        return DiskOffloadedOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
