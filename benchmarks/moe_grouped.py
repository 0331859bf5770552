"""Tokens/s of one MoE experts layer, dropless grouped against padded to the largest count, forward + backward.

    python benchmarks/moe_grouped.py [--device cpu|cuda] [--dtype float32|bfloat16] [--json benchmarks/moe_grouped.json]

One ``StackedExperts`` layer (SwiGLU, the Mixtral / Qwen-MoE / DeepSeek-V3 expert) behind the real ``dispatch`` /
``combine`` at ep 1; tokens routed top-k over ``E`` experts, either uniformly at random or skewed (expert ``e``
drawn with probability proportional to ``1 / (e + 1)``, the load imbalance an untrained or collapsing router gives:
the padded path then computes ``E x max_count`` rows for ``tokens x top_k`` real ones). Each cell times
``--steps`` forward + backward passes after ``--warmup`` (median per step of wall time, and of this process's CPU
time, which a CPU shared with other jobs disturbs less), for both implementations on the same weights, rows and
routing; the outputs of the two are checked equal first. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from oslo_models.parallel_layers.moe import StackedExperts, combine, dispatch  # noqa: E402

# (tokens, hidden, intermediate, experts, top_k)
SIZES = ((512, 256, 512, 8, 2), (2048, 256, 512, 8, 2), (2048, 512, 1024, 16, 4))


def route(tokens: int, experts: int, top_k: int, skewed: bool, generator) -> torch.Tensor:
    """``[tokens, top_k]`` distinct experts per token."""
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float) if skewed else torch.ones(experts)
    return torch.multinomial(weights.expand(tokens, experts), top_k, generator=generator)


def run_cell(tokens, hidden, intermediate, experts, top_k, skewed, *, device, dtype, steps, warmup) -> dict:
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = StackedExperts(experts, hidden, intermediate).to(device=device, dtype=dtype)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, hidden ** -0.5)
    x = torch.randn(tokens, hidden, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    index = route(tokens, experts, top_k, skewed, generator).to(device)
    weights = torch.rand(tokens, top_k, generator=generator).to(device=device, dtype=dtype)

    def step():
        routed = dispatch(x, index, experts, None)
        out = combine(layer(routed.rows, routed.local_counts), routed, weights, tokens, None)
        out.float().square().mean().backward()
        return out

    outputs, row = {}, {"tokens": tokens, "hidden": hidden, "intermediate": intermediate, "experts": experts,
                        "top_k": top_k, "routing": "skewed" if skewed else "uniform"}
    counts = torch.bincount(index.reshape(-1), minlength=experts)
    row["padded_rows"], row["real_rows"] = int(counts.max()) * experts, tokens * top_k
    for implementation in ("grouped", "padded"):
        layer.expert_implementation = implementation
        outputs[implementation] = step().detach()
        wall, cpu = [], []
        for i in range(warmup + steps):
            if device == "cuda":
                torch.cuda.synchronize()
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
        row[f"{implementation}_tokens_per_s"] = tokens / statistics.median(wall)
        row[f"{implementation}_tokens_per_cpu_s"] = tokens / statistics.median(cpu)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outputs["grouped"], outputs["padded"], **tolerance)
    row["speedup"] = row["grouped_tokens_per_s"] / row["padded_tokens_per_s"]
    row["cpu_speedup"] = row["grouped_tokens_per_cpu_s"] / row["padded_tokens_per_cpu_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = [run_cell(*size, skewed, device=args.device, dtype=dtype, steps=args.steps, warmup=args.warmup)
            for size in SIZES for skewed in (False, True)]
    machine = (torch.cuda.get_device_name() if args.device == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"MoE experts forward+backward, {args.device} {args.dtype} ({machine}), torch {torch.__version__}")
    print(f"{'tokens':>7}{'hidden':>7}{'inter':>6}{'E':>4}{'k':>3}{'routing':>9}{'real':>7}{'padded':>8}"
          f"{'grouped tok/s':>15}{'padded tok/s':>14}{'speedup':>9}{'grouped tok/cpu-s':>19}{'padded tok/cpu-s':>18}"
          f"{'speedup':>9}")
    for r in rows:
        print(f"{r['tokens']:>7}{r['hidden']:>7}{r['intermediate']:>6}{r['experts']:>4}{r['top_k']:>3}"
              f"{r['routing']:>9}{r['real_rows']:>7}{r['padded_rows']:>8}{r['grouped_tokens_per_s']:>15.0f}"
              f"{r['padded_tokens_per_s']:>14.0f}{r['speedup']:>8.2f}x{r['grouped_tokens_per_cpu_s']:>19.0f}"
              f"{r['padded_tokens_per_cpu_s']:>18.0f}{r['cpu_speedup']:>8.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"torch": torch.__version__, "device": args.device, "dtype": args.dtype, "machine": machine,
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
