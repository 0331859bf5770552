"""Shared checks for the fused-op tests.

``check_op`` runs the fused function (forced onto its Triton kernel) and each reference on the same inputs and
the same upstream gradient, then compares the outputs and every requested gradient:

- fp32: within ``atol = rtol = 1e-5``;
- bf16/fp16: the fused error against the fp32 ground truth (the reference run on the same low-precision
  values upcast to fp32) may be at most twice the error of the reference run in low precision, plus a tiny
  epsilon. The bound scales with the op instead of guessing an atol.
"""
from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch

from oslo_models.fused_ops._utils import HAS_TRITON, interpreter_enabled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not interpreter_enabled()),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
# Tests that run the kernels on CPU tensors (gloo ranks, dispatch checks): the interpreter only, not a GPU machine.
requires_interpreter = pytest.mark.skipif(
    not HAS_TRITON or not interpreter_enabled(), reason="runs the kernels on CPU tensors: needs TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.bfloat16]
BF16_EPS = 1e-6


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run_fwd_bwd(fn: Callable, inputs: Sequence, grad_idx: Sequence[int], upcast: bool = False, seed: int = 1234,
                unit_dy: bool = False):
    """``fn(*inputs)`` and the grads of ``sum(out * dy)`` w.r.t. ``inputs[grad_idx]``; dy is seeded (or 1)."""
    args = []
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor):
            t = t.detach().clone()
            if upcast and t.is_floating_point():
                t = t.float()
            if i in grad_idx:
                t.requires_grad_(True)
        args.append(t)
    outs = _flat(fn(*args))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # dy is drawn in the op's own dtype so the fp32 truth sees exactly the same upstream gradient.
    dys = [torch.randn(o.shape, generator=gen).to(inputs_dtype(inputs)).to(o.device).to(o.dtype) for o in outs]
    if unit_dy:
        dys = [torch.ones_like(o) for o in outs]
    grads = torch.autograd.grad(outs, [args[i] for i in grad_idx], dys, allow_unused=True) if grad_idx else ()
    return [o.detach() for o in outs], list(grads)


def inputs_dtype(inputs: Sequence) -> torch.dtype:
    return next(t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point())


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def assert_low_precision_close(actual, truth, plain, what: str, eps: float = BF16_EPS) -> None:
    assert actual.shape == truth.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(truth.shape)}"
    assert torch.isfinite(actual.float()).equal(torch.isfinite(truth.float())), f"{what}: NaN/inf pattern differs"
    err, plain_err = max_err(actual, truth), max_err(plain, truth)
    assert err <= 2 * plain_err + eps, f"{what}: fused error {err:.3g} > 2 x plain {actual.dtype} error {plain_err:.3g}"


def check_op(fused: Callable, references: dict[str, Callable], inputs: Sequence, grad_idx: Sequence[int],
             atol: float = 1e-5, rtol: float = 1e-5, eps: float = BF16_EPS, unit_dy: bool = False) -> None:
    """``unit_dy``: upstream grad 1 instead of random (a scalar loss as ``loss.backward()`` sees it)."""
    out, grads = run_fwd_bwd(fused, inputs, grad_idx, unit_dy=unit_dy)
    names = ["out"] * len(out) + [f"grad[{i}]" for i in grad_idx]
    fused_all = out + grads
    assert all(g is not None for g in grads), "fused op returned no gradient for a differentiable input"
    low_precision = inputs_dtype(inputs) != torch.float32
    for ref_name, ref in references.items():
        ref_out, ref_grads = run_fwd_bwd(ref, inputs, grad_idx, unit_dy=unit_dy)
        if not low_precision:
            for name, a, b in zip(names, fused_all, ref_out + ref_grads):
                torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{ref_name} {name}: {m}")
            continue
        truth_out, truth_grads = run_fwd_bwd(ref, inputs, grad_idx, upcast=True, unit_dy=unit_dy)
        for name, a, t, p in zip(names, fused_all, truth_out + truth_grads, ref_out + ref_grads):
            assert a.dtype == p.dtype, f"{ref_name} {name}: dtype {a.dtype} != {p.dtype}"
            assert_low_precision_close(a, t, p, f"{ref_name} {name}", eps)
