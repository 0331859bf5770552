"""The longest sequence a Llama-shaped model trains one step at under a fixed CPU memory cap, for today's default and
with the long-sequence tools; and packed against padded tokens per second (issue 52).

    python benchmarks/long_sequence.py [--cap 1.5GiB] [--fit 1024 2048 4096] [--threads 1] [--json PATH]
                                       [--no-verify] [--no-packing]

Model: ``LlamaConfig(hidden 256, intermediate 688, 4 layers, 8 heads, 4 key/value heads, vocab 32000)``, fp32, one
row, AdamW. Each measurement is one fresh subprocess (``--child``): it builds the model, runs a warm-up step at 128
tokens (so the optimizer state exists), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), runs one
training step (forward, backward, AdamW) at ``s`` tokens and reports the step's peak RSS (``VmHWM``: the whole
process, the model, gradients and optimizer state included) and its wall time.

Variants: ``default`` (logits materialized, no checkpointing); ``checkpointing`` (``activation_checkpointing=
"full"``); ``tiled`` (full checkpointing + ``tiled_mlp="auto"`` + the tiled loss ``skip_logits=True``: ALST's
recipe); ``tiled+offload`` (``activation_checkpointing="offload"``: the checkpointed block inputs in host memory,
+ the tiling); ``offload`` (``activation_offload=True`` without checkpointing, + the tiling). On a CPU-only machine
host memory *is* the memory measured, so offload cannot lower the peak RSS (it adds the copies in flight); the rows
say what the GPU path would move off the device, not a CPU saving.

The longest length under ``--cap``: the peak RSS is linear in ``s`` for every variant here (SDPA's CPU kernel keeps
no ``[s, s]`` tensor), so it is fitted at the ``--fit`` lengths (least squares) and solved for the cap, rounded
down to a multiple of 256; unless ``--no-verify``, one step at that length is run and its measured peak reported
(``fits``: at or under the cap). Packed vs padded: ``benchmarks/packed_vs_padded.py``'s training cells (same
documents, per-document attention), real tokens per CPU-second. Prints tables, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {
    "default": (dict(), False),
    "checkpointing": (dict(activation_checkpointing="full"), False),
    "tiled": (dict(activation_checkpointing="full", tiled_mlp="auto"), True),
    "tiled+offload": (dict(activation_checkpointing="offload", tiled_mlp="auto"), True),
    "offload": (dict(activation_offload=True, tiled_mlp="auto"), True),
}
VERIFIED = ("default", "checkpointing", "tiled", "tiled+offload")


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def child(variant: str, seq: int, threads: int) -> dict:
    """One training step at ``seq`` tokens in this (fresh) process: its peak RSS and wall time."""
    import torch
    import transformers

    import oslo_models as om

    torch.set_num_threads(threads)
    options, tiled_loss = VARIANTS[variant]
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=max(seq, 4096))
    torch.manual_seed(0)
    model = om.LlamaForCausalLM.from_config(config, parallel=om.ParallelConfig(**options)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    call = {"skip_logits": True} if tiled_loss else {}

    def step(length: int) -> float:
        ids = torch.randint(1, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        loss = model(input_ids=ids, labels=ids, **call).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    step(128)  # the optimizer state exists from here on
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM (the peak RSS) to the current RSS
    start = time.perf_counter()
    loss = step(seq)
    return dict(variant=variant, seq=seq, peak_rss=_status("VmHWM"), baseline_rss=baseline,
                seconds=time.perf_counter() - start, loss=loss)


def measure(variant: str, seq: int, threads: int, timeout: float = 1800) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant, str(seq), str(threads)],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if out.returncode:
        raise RuntimeError(f"{variant} at {seq}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least squares ``peak = a + b * s``."""
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    slope = sum((s - mean_s) * (p - mean_p) for s, p in points) / sum((s - mean_s) ** 2 for s, _ in points)
    return mean_p - slope * mean_s, slope


def parse_bytes(text: str) -> int:
    from oslo_models.planner import parse_bytes as parse

    return parse(text)


def longest(args) -> list[dict]:
    rows = []
    for variant in args.variants:
        points = [measure(variant, seq, args.threads) for seq in args.fit]
        intercept, slope = fit_line([(p["seq"], p["peak_rss"]) for p in points])
        predicted = int((args.cap - intercept) / slope) // 256 * 256 if slope > 0 else None
        row = dict(variant=variant, fit=points, intercept=intercept, bytes_per_token=slope, predicted=predicted)
        if args.verify and variant in VERIFIED and predicted and predicted > 0:
            tried = []
            for _ in range(3):  # over the cap: shrink the headroom in proportion and run again
                check = measure(variant, predicted, args.threads)
                tried.append(dict(seq=predicted, peak_rss=check["peak_rss"], seconds=check["seconds"]))
                if check["peak_rss"] <= args.cap:
                    break
                predicted = int(predicted * (args.cap - intercept) / (check["peak_rss"] - intercept)) // 256 * 256
            row.update(verified=tried, longest_verified=predicted if check["peak_rss"] <= args.cap else None,
                       verified_peak=check["peak_rss"], verified_seconds=check["seconds"],
                       fits=check["peak_rss"] <= args.cap)
        rows.append(row)
        print(f"{variant:14s} {slope / 1024:9.1f} KiB/token  longest ~{predicted}  "
              f"{'verified ' + format(row.get('verified_peak', 0) / 2**20, '.0f') + ' MiB' if 'fits' in row else ''}",
              flush=True)
    return rows


def table(rows: list[dict], cap: int) -> str:
    base = next((r["predicted"] for r in rows if r["variant"] == "default"), None)
    lines = [f"cap {cap / 2**30:.2f} GiB peak RSS (whole process)",
             "| variant | KiB per token (fit) | longest s (fit) | x default | steps run: s -> peak RSS, time |",
             "|---|---|---|---|---|"]
    for r in rows:
        runs = "; ".join(f"{t['seq']} -> {t['peak_rss'] / 2**20:.0f} MiB ({'fits' if t['peak_rss'] <= cap else 'OVER'}"
                         f"), {t['seconds']:.0f} s" for t in r.get("verified", [])) or "not run"
        ratio = f"{r['predicted'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['variant']} | {r['bytes_per_token'] / 1024:.1f} | {r['predicted']} | {ratio} | {runs} |")
    return "\n".join(lines)


def packing(threads: int) -> list[dict]:
    import torch

    from benchmarks import packed_vs_padded as pvp

    torch.set_num_threads(threads)
    model = pvp.build_model(32000)
    return [pvp.run_cell(model, 32000, docs, lo, hi, budget, steps=3, warmup=1, forward_only=False)
            for docs, lo, hi, budget in pvp.CELLS]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "SEQ", "THREADS"), help=argparse.SUPPRESS)
    parser.add_argument("--cap", default="1.5GiB")
    parser.add_argument("--fit", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-verify", dest="verify", action="store_false")
    parser.add_argument("--no-packing", dest="packing", action="store_false")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.child:
        variant, seq, threads = args.child
        print(json.dumps(child(variant, int(seq), int(threads))))
        return
    args.cap = parse_bytes(args.cap)

    def write(rows, packed):
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(dict(machine=platform.platform(), cpus=os.cpu_count(), threads=args.threads, cap=args.cap,
                               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), longest=rows,
                               packing=packed), handle, indent=1)

    rows = longest(args)
    print(table(rows, args.cap))
    write(rows, [])  # the longer part first, in case the packing cells are stopped
    packed = packing(args.threads) if args.packing else []
    for cell in packed:
        print(json.dumps(cell))
    write(rows, packed)


if __name__ == "__main__":
    main()
