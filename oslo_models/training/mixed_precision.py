"""Mixed precision for parallel models: bf16 through Accelerate's autocast, fp16 loss scaling kept in step.

bf16 and fp16 autocast come from Accelerate (``Accelerator(mixed_precision=...)``; :func:`prepare` installs it on
the model's forward). fp16 also needs a loss scaler, and the scaler's "skip this step" decision is *per rank*:
``GradScaler.unscale_`` looks only at the gradients this rank holds. With tensor parallelism (and ZeRO-2/3) ranks
hold different pieces of the gradient, so an inf in one rank's shard would make that rank skip the step while the
others apply it, and the replicas drift apart silently. :func:`sync_overflow` makes the decision global with one
all-reduce (MAX) of the found-inf flags over the world; :func:`~oslo_models.training.clip_grad_norm_` does the same
from the global gradient norm, so a loop that clips needs nothing else.

Accelerate creates no scaler on CPU and ignores ``mixed_precision="fp16"`` there (it trains in fp32);
:func:`check_mixed_precision` turns that into an error instead of a silent fp32 run.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _found_inf_flags(scaler) -> list[torch.Tensor]:
    # GradScaler keeps, per optimizer it unscaled this step, one found-inf flag per device. There is no public
    # accessor; these flags are exactly what GradScaler.step reads to decide whether to skip.
    states = getattr(scaler, "_per_optimizer_states", {}) or {}
    return [flag for state in states.values() for flag in state.get("found_inf_per_device", {}).values()]


def mark_overflow(scaler) -> None:
    """Make ``scaler`` skip the coming ``step`` for every optimizer it has unscaled (no-op without a scaler)."""
    if scaler is None:
        return
    for flag in _found_inf_flags(scaler):
        flag.fill_(1.0)


def sync_overflow(scaler, context) -> bool:
    """After ``scaler.unscale_(optimizer)``: agree over all ranks whether any gradient overflowed.

    One all-reduce (MAX) over the default group, so tp, dp and pp ranks all skip together. Returns ``True`` when
    the step will be skipped. Call on every rank; a no-op (``False``) without a scaler.
    """
    if scaler is None:
        return False
    flags = _found_inf_flags(scaler)
    local = torch.stack([f.float().sum().cpu() for f in flags]).sum() if flags else torch.zeros(())
    found = (local > 0).float()
    if context.world_size > 1 and dist.is_initialized():
        found = found.to(context.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    overflow = bool(found.item() > 0)
    if overflow:
        mark_overflow(scaler)
    return overflow


def check_mixed_precision(accelerator) -> str:
    """The effective mixed-precision mode of ``accelerator``; ``ValueError`` when Accelerate would silently
    train in fp32 instead (fp16 on a CPU)."""
    mode = str(accelerator.mixed_precision)
    if mode == "fp16" and accelerator.scaler is None and accelerator.device.type == "cpu":
        raise ValueError("mixed_precision='fp16' needs a GPU (Accelerate ignores it on CPU and would train in fp32); "
                         "use 'bf16' on CPU")
    return mode
