"""Benchmark the fused ops against torch eager, torch.compile and Liger-Kernel (when installed).

For each op and size: median forward+backward time, peak extra memory, and for the memory-bound ops the achieved
GB/s against the device-to-device copy bandwidth measured in the same run. Prints a table and writes JSON.

    python benchmarks/fused_ops.py                      # full sweep on a CUDA GPU, writes fused_ops_bench.json
    python benchmarks/fused_ops.py --ops rms_norm,flce  # a subset
    python benchmarks/fused_ops.py --smoke              # tiny CPU run (reference path) to check the script

Targets (issue 4): norms fwd+bwd at >= 80% of copy bandwidth and no slower than Liger; fused linear-cross-entropy
peak memory <= 25% of eager at vocab 50257.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from oslo_models import fused_ops  # noqa: E402

try:
    from liger_kernel.transformers import functional as liger  # optional comparison
except Exception:  # noqa: BLE001 - any import problem just means "no Liger column"
    liger = None


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn, iters):
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)
    else:
        def run(fn, iters):
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
    return run


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Read + write GB/s of a large device-to-device copy: the ceiling for memory-bound kernels."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    run = _timer(device)
    for _ in range(3):
        dst.copy_(src)
    ms = run(lambda: dst.copy_(src), 10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _peak_extra_mb(fn, device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _fwd_bwd(fn, inputs):
    def step():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.backward(torch.ones_like(out) if out.dim() else None)
    return step


def _cases(args, device, dtype):
    """Yield (op, size label, bytes moved fwd+bwd or None, make_inputs, {provider: fn})."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype).requires_grad_(True)

    es = torch.tensor([], dtype=dtype).element_size()
    for tokens in args.tokens:
        for hidden in args.hidden:
            moved = 5 * tokens * hidden * es  # fwd: read x, write y; bwd: read x, dy, write dx
            if "layer_norm" in args.ops:
                providers = {"eager": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
                             "oslo": lambda x, w, b: fused_ops.layer_norm(x, w, b, force_triton=True)}
                if liger is not None and hasattr(liger, "liger_layer_norm"):
                    providers["liger"] = lambda x, w, b: liger.liger_layer_norm(x, w, b, 1e-5)
                yield ("layer_norm", f"{tokens}x{hidden}", moved,
                       lambda: [randn(tokens, hidden), randn(hidden), randn(hidden)], providers)
            if "rms_norm" in args.ops:
                providers = {"eager": lambda x, w: fused_ops.rms_norm_reference(x, w, 1e-6),
                             "oslo": lambda x, w: fused_ops.rms_norm(x, w, 1e-6)}
                if liger is not None and hasattr(liger, "liger_rms_norm"):
                    providers["liger"] = lambda x, w: liger.liger_rms_norm(x, w, 1e-6)
                yield ("rms_norm", f"{tokens}x{hidden}", moved, lambda: [randn(tokens, hidden), randn(hidden)],
                       providers)
            if "bias_gelu" in args.ops:
                ffn = 4 * hidden
                yield ("bias_gelu", f"{tokens}x{ffn}", 4 * tokens * ffn * es,
                       lambda: [randn(tokens, ffn), randn(ffn)],
                       {"eager": lambda x, b: F.gelu(x + b, approximate="tanh"),
                        "oslo": lambda x, b: fused_ops.bias_gelu(x, b, "tanh")})
        for vocab in args.vocab:
            if "cross_entropy" in args.ops:
                labels = torch.randint(0, vocab, (tokens,), device=device)
                providers = {"eager": lambda x: F.cross_entropy(x, labels),
                             "oslo": lambda x: fused_ops.cross_entropy(x, labels)}
                if liger is not None and hasattr(liger, "liger_cross_entropy"):
                    providers["liger"] = lambda x: liger.liger_cross_entropy(x, labels)
                yield ("cross_entropy", f"{tokens}x{vocab}", None, lambda: [randn(tokens, vocab)], providers)
            if "flce" in args.ops:
                hidden = args.hidden[0]
                labels = torch.randint(0, vocab, (tokens,), device=device)
                providers = {"eager": lambda h, w: F.cross_entropy(h @ w.t(), labels),
                             "oslo": lambda h, w: fused_ops.fused_linear_cross_entropy(h, w, labels)}
                if liger is not None and hasattr(liger, "liger_fused_linear_cross_entropy"):
                    providers["liger"] = lambda h, w: liger.liger_fused_linear_cross_entropy(h, w, labels)
                yield ("flce", f"{tokens}x{hidden}->{vocab}", None,
                       lambda: [randn(tokens, hidden), randn(vocab, hidden, scale=0.02)], providers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="layer_norm,rms_norm,bias_gelu,cross_entropy,flce")
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--hidden", default="768,4096,8192")
    parser.add_argument("--vocab", default="50257,128256")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, reference path only")
    parser.add_argument("--json", default="fused_ops_bench.json")
    args = parser.parse_args()
    args.ops = args.ops.split(",")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    args.tokens, args.hidden, args.vocab = ints(args.tokens), ints(args.hidden), ints(args.vocab)
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.iters, args.no_compile = [64], [96], [1000], 2, True
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: GPU figures cannot be measured here (use --smoke to check the script)")
    dtype = getattr(torch, args.dtype)
    run = _timer(device)
    copy_gbs = copy_bandwidth_gbs(device, 1 << 30 if device.type == "cuda" else 1 << 24)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"# {machine}, torch {torch.__version__}, copy bandwidth {copy_gbs:.0f} GB/s, dtype {args.dtype}")
    print(f"{'op':<14}{'size':<22}{'provider':<10}{'ms':>9}{'peak MB':>10}{'GB/s':>9}{'% copy':>8}")
    rows = []
    for op, size, moved, make_inputs, providers in _cases(args, device, dtype):
        if not args.no_compile:
            providers["compile"] = torch.compile(providers["eager"])
        for name, fn in providers.items():
            inputs = make_inputs()
            step = _fwd_bwd(fn, inputs)
            try:
                for _ in range(3):
                    step()
                ms = run(step, args.iters)
                peak = _peak_extra_mb(step, device)
            except Exception as exc:  # noqa: BLE001 - one failing provider must not end the sweep
                print(f"{op:<14}{size:<22}{name:<10} failed: {type(exc).__name__}: {exc}")
                continue
            gbs = moved / (ms * 1e-3) / 1e9 if moved else float("nan")
            print(f"{op:<14}{size:<22}{name:<10}{ms:>9.3f}{peak:>10.1f}{gbs:>9.0f}{100 * gbs / copy_gbs:>7.0f}%")
            rows.append(dict(op=op, size=size, provider=name, ms=ms, peak_mb=peak, gbs=gbs,
                             pct_copy=100 * gbs / copy_gbs))
            del inputs, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    with open(args.json, "w") as fh:
        json.dump(dict(machine=machine, torch=torch.__version__, dtype=args.dtype, copy_gbs=copy_gbs,
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(), rows=rows), fh, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
