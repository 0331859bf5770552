"""How the local experts run: rows sorted by expert through one grouped matmul (dropless), or padded to a capacity.

Layouts (``E`` local experts, ``counts[e]`` rows of expert ``e``, ``R = sum(counts)``):

- **grouped** (the default): ``rows [R, k]``, expert ``e``'s rows contiguous and in expert order; a projection
  ``weight [E, k, n]`` gives ``[R, n]``. No row is padded or dropped. On CUDA (compute capability >= 8.0, bf16,
  16-byte aligned strides) this is one ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` kernel; elsewhere
  (CPU, fp32) a loop of ``torch.mm`` over the contiguous slices, registered as the custom op
  ``oslo_models::grouped_mm`` (forward and backward each one op with a fake), so ``torch.compile`` sees one node
  whose output shape is known without running it.
- **padded**: the rows laid out as ``[E, C, k]`` (``C`` = the largest count, zero rows padding the others) and
  multiplied with ``torch.bmm``. Kept as the baseline the grouped path is measured against
  (``benchmarks/moe_grouped.py``) and as a second, independent computation for the parity tests
  (``set_expert_implementation(model, "padded")``); it computes the same numbers.

An expert module writes its feed-forward once against a ``Grouping`` (``mm(x, weight)``, ``bias(b)``) and runs in
either layout. No communication here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("grouped", "padded")


def _native_grouped_mm(rows: torch.Tensor, weight: torch.Tensor):
    """``torch``'s grouped-GEMM kernel when it can run these operands, else ``None``."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None or not (rows.is_cuda and weight.is_cuda) or rows.dtype != torch.bfloat16 \
            or weight.dtype != torch.bfloat16:
        return None
    if torch.cuda.get_device_capability(weight.device) < (8, 0):
        return None
    aligned = all(stride == 1 or (stride * t.element_size()) % 16 == 0
                  for t in (rows, weight) for stride in t.stride())
    return fn if aligned else None


@torch.library.custom_op("oslo_models::grouped_mm", mutates_args=())
def _grouped_mm_loop(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = rows.new_empty((rows.shape[0], weight.shape[2]))
    start = 0
    for expert, count in enumerate(counts.tolist()):  # one host sync for the whole loop
        if count:
            torch.mm(rows[start:start + count], weight[expert], out=out[start:start + count])
            start += count
    out[start:].zero_()  # rows after the last expert's (dispatch's dropped assignments at ep 1)
    return out


@_grouped_mm_loop.register_fake
def _(rows, weight, counts):
    return rows.new_empty((rows.shape[0], weight.shape[2]))


@torch.library.custom_op("oslo_models::grouped_mm_backward", mutates_args=())
def _grouped_mm_loop_backward(grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                              counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_rows = torch.empty_like(rows, memory_format=torch.contiguous_format)
    grad_weight = weight.new_zeros(weight.shape)  # an expert with no rows gets a zero gradient
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            piece = grad[start:start + count]
            torch.mm(piece, weight[expert].t(), out=grad_rows[start:start + count])
            torch.mm(rows[start:start + count].t(), piece, out=grad_weight[expert])
            start += count
    grad_rows[start:].zero_()
    return grad_rows, grad_weight


@_grouped_mm_loop_backward.register_fake
def _(grad, rows, weight, counts):
    return rows.new_empty(rows.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    rows, weight, counts = inputs
    ctx.save_for_backward(rows, weight, counts)


def _backward(ctx, grad):
    rows, weight, counts = ctx.saved_tensors
    grad_rows, grad_weight = torch.ops.oslo_models.grouped_mm_backward(grad.contiguous(), rows, weight, counts)
    return grad_rows, grad_weight, None


torch.library.register_autograd("oslo_models::grouped_mm", _backward, setup_context=_setup_context)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows [R, k]`` (``counts[e]`` contiguous rows per expert, in expert order) times ``weight [E, k, n]`` ->
    ``[R, n]``: row block ``e`` times ``weight[e]``. Differentiable in ``rows`` and ``weight``. Rows after
    ``sum(counts)`` belong to no expert: zero on the loop, unspecified from torch's kernel (callers mask them)."""
    rows = rows.to(weight.dtype)
    native = _native_grouped_mm(rows, weight)
    if native is not None:
        return native(rows, weight, offs=torch.cumsum(counts, 0, dtype=torch.int32))
    return torch.ops.oslo_models.grouped_mm(rows, weight, counts)


class Grouping:
    """The grouped layout: ``x [R, k]``; ``mm`` is ``grouped_mm``, ``bias`` gives each row its expert's bias."""

    def __init__(self, counts: torch.Tensor, num_rows: int):
        self.counts, self.num_rows = counts, num_rows

    def mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x, weight, self.counts)

    def bias(self, bias: torch.Tensor) -> torch.Tensor:
        """``[E, n]`` -> ``[R, n]`` (rows after ``sum(counts)`` get the last expert's; static shapes)."""
        rows = torch.arange(self.num_rows, device=self.counts.device)
        expert = torch.searchsorted(torch.cumsum(self.counts, 0), rows, right=True)
        return bias.index_select(0, expert.clamp(max=bias.shape[0] - 1))


class PaddedGrouping:
    """The padded layout: ``x [E, C, k]``; ``mm`` is ``torch.bmm``, ``bias`` broadcasts over the ``C`` slots."""

    def mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.to(weight.dtype), weight)

    def bias(self, bias: torch.Tensor) -> torch.Tensor:
        return bias[:, None]


def run_padded(run, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``run(x [E, C, k], PaddedGrouping()) -> [E, C, n]`` on ``rows [R, k]`` padded per expert to the largest
    count ``C``; returns the ``R`` real rows ``[R, n]`` (the padding rows' outputs are dropped, so they add nothing
    to any gradient)."""
    local, num_rows = counts.shape[0], int(counts.sum())
    if num_rows < rows.shape[0]:  # rows after the last expert's (dispatch's dropped assignments at ep 1): zeros
        out = run_padded(run, rows[:num_rows], counts)
        return torch.cat([out, out.new_zeros((rows.shape[0] - num_rows, out.shape[-1]))])
    capacity = int(counts.max()) if counts.numel() else 0
    offsets = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(local, device=rows.device), counts)
    slot = torch.arange(rows.shape[0], device=rows.device) - offsets.index_select(0, expert)
    padded = rows.new_zeros((local, capacity, rows.shape[-1])).index_put((expert, slot), rows)
    return run(padded, PaddedGrouping())[expert, slot]


def set_expert_implementation(model: torch.nn.Module, implementation: str) -> int:
    """Run every stacked-experts module of ``model`` ``"grouped"`` (the default) or ``"padded"``; returns how many
    modules were set. Per model, no global switch."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"expert implementation {implementation!r} is not one of {IMPLEMENTATIONS}")
    modules = [module for module in model.modules() if hasattr(module, "expert_implementation")]
    for module in modules:
        module.expert_implementation = implementation
    return len(modules)
