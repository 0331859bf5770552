"""Small helpers shared by the fused ops: the guarded Triton import, block sizes, row views.

Triton is optional. When it cannot be imported, ``triton`` and ``tl`` below are tiny stand-ins that let the
op modules *define* their kernels (``@triton.jit`` returns the function unchanged, ``tl.constexpr`` exists for
the annotations) so that ``import oslo_models.fused_ops`` always works; the dispatcher never routes a call to a
kernel in that case, so the stand-ins are never executed.
"""
from __future__ import annotations

import os
import types

import torch

try:  # pragma: no cover - exercised by whichever environment runs the tests
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    triton = types.SimpleNamespace(jit=_jit, cdiv=lambda a, b: -(-a // b))
    tl = types.SimpleNamespace(constexpr=object)

# The largest row a single-block kernel holds in registers. Past this the row kernels would spill, so the
# launchers refuse instead of silently running slowly (the looped kernels, cross-entropy, have no limit).
MAX_FUSED_BLOCK = 65536
# Block used by the looped (vocab) and element-wise kernels.
LOOP_BLOCK = 4096
ELEMENTWISE_BLOCK = 1024


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def row_block_settings(n_cols: int, op: str) -> tuple[int, int]:
    """Block size (one row per program, padded to a power of two) and num_warps for a row kernel."""
    block = next_power_of_2(n_cols)
    if block > MAX_FUSED_BLOCK:
        raise ValueError(f"{op}: last dimension {n_cols} is larger than the fused kernel supports "
                         f"({MAX_FUSED_BLOCK}); pass enabled=False to use the torch reference")
    # More warps for wider rows so each thread holds a bounded number of elements (about 8-16).
    num_warps = 4 if block < 2048 else 8 if block < 8192 else 16 if block < 32768 else 32
    return block, num_warps


def num_reduction_programs(device: torch.device, n_rows: int) -> int:
    """Programs for the backward kernels that sum weight/bias grads over rows (one fp32 partial each)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, 2 * sms))
    # The interpreter runs programs one after another; a few are enough to exercise the partial sums.
    return max(1, min(n_rows, 4))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` -> contiguous ``[rows, n]`` (a view when ``x`` is already contiguous)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def interpreter_enabled() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def bias_grad(dx: torch.Tensor, bias_dtype: torch.dtype | None) -> torch.Tensor | None:
    """The gradient of a bias added over ``dx``'s last dimension: rows summed in fp32, in the bias's dtype;
    ``None`` where there is no bias."""
    if bias_dtype is None:
        return None
    return dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(bias_dtype)
