"""Make the Triton CPU interpreter round fp32 -> bf16 to nearest even, as the GPU does.

Triton's interpreter (checked in 3.9) implements the plain ``x.to(tl.bfloat16)`` truncation by dropping the low
mantissa bits, i.e. rounding toward zero, while compiled kernels round to nearest even (LLVM ``fptrunc``). The
kernels here are written for the GPU semantics; without this fix every bf16 store on CPU is up to one ulp off
and the "no worse than twice plain bf16 torch" checks would be testing the interpreter, not the kernels. The
fix is scoped to the test process and to this one conversion; nothing in ``oslo_models`` depends on it.
"""
from __future__ import annotations

import numpy as np
import torch

from oslo_models.fused_ops._utils import HAS_TRITON, interpreter_enabled


def _install_rtne_bf16() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_oslo_rtne_bf16", False):
        return
    original = builder.create_fp_trunc

    def create_fp_trunc(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(data.numpy().view(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    builder.create_fp_trunc = create_fp_trunc
    builder._oslo_rtne_bf16 = True


if HAS_TRITON and interpreter_enabled():
    _install_rtne_bf16()
