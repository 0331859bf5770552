"""Non-finite losses and gradient norms, found on every rank together.

A NaN can appear on one rank only: data-parallel ranks see different batches, a pipeline's last stage computes the
loss, a tensor-parallel shard overflows. A loop that checks ``math.isfinite(loss)`` on its own rank then stops on
some ranks while the others walk into the next collective (a hang), or skips the optimizer step on some ranks only
(replicas drift apart silently). :func:`find_nonfinite` makes it one decision: one ``all_gather`` of a flag per
rank over the world, so every rank gets the same answer, naming the ranks that saw what.

What a loop does with the answer (``examples/_common.py``):

- fp32/bf16: stop *before* ``optimizer.step()`` with :class:`NonFiniteError` on every rank, so no NaN reaches the
  weights and no checkpoint is written over the last good one (``save_checkpoint`` also refuses non-finite
  parameters itself);
- fp16 with a ``GradScaler``: the step is skipped on every rank and the scale lowered, as ``GradScaler`` does
  (``clip_grad_norm_(..., accelerator=...)`` marks the overflow on every rank; this module only reports it).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .zero import unwrap_model

_LOSS, _NORM = 1, 2


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm was NaN or infinite (raised on every rank alike)."""


def _flag(value, bit: int) -> int:
    if value is None:
        return 0
    number = value.detach().float().cpu().item() if isinstance(value, torch.Tensor) else float(value)
    return 0 if math.isfinite(number) else bit


def find_nonfinite(model_or_context, *, loss=None, grad_norm=None) -> dict[str, list[int]]:
    """``{"loss": [ranks], "grad_norm": [ranks]}`` of the ranks where ``loss`` / ``grad_norm`` is NaN or inf, the
    same on every rank (empty lists: all finite). Collective over the world (one all-gather of one int per rank);
    call on every rank. ``model_or_context``: an ``oslo_models`` model (any wrapper) or its ``ParallelContext``."""
    context = getattr(model_or_context, "parallel_context", None) or model_or_context
    if not hasattr(context, "world_size"):
        context = unwrap_model(model_or_context).parallel_context
    mine = _flag(loss, _LOSS) | _flag(grad_norm, _NORM)
    if context.world_size > 1 and dist.is_initialized():
        local = torch.tensor([mine], dtype=torch.int32, device=context.device)
        gathered = torch.zeros(context.world_size, dtype=torch.int32, device=context.device)
        dist.all_gather_into_tensor(gathered, local)
        flags = gathered.tolist()
    else:
        flags = [mine]
    return {"loss": [rank for rank, flag in enumerate(flags) if flag & _LOSS],
            "grad_norm": [rank for rank, flag in enumerate(flags) if flag & _NORM]}


def describe_nonfinite(found: dict[str, list[int]], *, step: int | None = None) -> str | None:
    """One sentence for :func:`find_nonfinite`'s answer (``None`` when everything was finite)."""
    parts = [f"the {what.replace('_', ' ')} on rank(s) {ranks}" for what, ranks in found.items() if ranks]
    if not parts:
        return None
    where = f" at step {step}" if step is not None else ""
    return f"non-finite (NaN/inf) values{where}: {' and '.join(parts)}"


def check_finite(model_or_context, *, loss=None, grad_norm=None, step: int | None = None) -> None:
    """Raise :class:`NonFiniteError` on every rank when ``loss`` or ``grad_norm`` is not finite on any rank
    (collective, see :func:`find_nonfinite`)."""
    text = describe_nonfinite(find_nonfinite(model_or_context, loss=loss, grad_norm=grad_norm), step=step)
    if text is not None:
        raise NonFiniteError(text)
