"""Tokens/s of a small Llama trained on the same documents packed into rows against padded one per row.

    python benchmarks/packed_vs_padded.py [--threads 1] [--steps 5] [--warmup 1] [--json benchmarks/packed.json]

The documents of a cell (``--docs`` of them, lengths drawn uniformly from ``[lo, hi]`` with a fixed seed) are
collated twice with the library's collators: padded, one document per row to the longest
(``CausalLMCollator(pad_token_id=0)``), and packed first-fit into rows of ``--budget`` tokens
(``CausalLMCollator(pack_to=budget)``: per-document attention, on CPU through SDPA with the dense per-document mask).
Each variant runs ``--steps`` forward + backward passes after ``--warmup`` on the same native Llama (fp32, CPU);
reported: the median per step of wall time and of this process's CPU time (which other jobs on a shared CPU disturb
less), as real (non-padding) tokens per second. The losses of the two layouts are checked equal first (the same
documents, the same targets). ``--forward`` times forward passes only and adds packed through FlexAttention (it has
no CPU backward; compiled, so its compile is in the warm-up). Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import oslo_models as om  # noqa: E402

# (documents, shortest, longest, packing budget)
CELLS = ((16, 32, 512, 1024), (32, 16, 256, 1024))


def build_model(vocab: int):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    torch.manual_seed(0)
    return om.AutoModelForCausalLM.from_config(config).train()


def timed(model, batch, *, steps: int, warmup: int, forward_only: bool) -> tuple[float, float, float]:
    """(median wall s, median CPU s, loss) per step."""
    count = int((batch["labels"][:, 1:] != -100).sum())
    walls, cpus, loss = [], [], None
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.process_time()
        if forward_only:
            with torch.no_grad():
                loss = model(**batch, num_items_in_batch=count).loss
        else:
            loss = model(**batch, num_items_in_batch=count).loss
            loss.backward()
        if i >= warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), float(loss.detach())


def run_cell(model, vocab, docs, lo, hi, budget, *, steps, warmup, forward_only) -> dict:
    rng = np.random.default_rng(0)
    documents = [rng.integers(3, vocab, int(n)) for n in rng.integers(lo, hi + 1, docs)]
    tokens = sum(d.size for d in documents)
    padded = om.data.CausalLMCollator(pad_token_id=0)(documents)
    packed = om.data.CausalLMCollator(pack_to=budget)(documents)
    variants = [("padded", padded, "sdpa"), ("packed", packed, "sdpa")]
    if forward_only:
        variants.append(("packed, flex", packed, "flex_attention"))
    row = dict(documents=docs, lengths=[lo, hi], budget=budget, real_tokens=tokens,
               padded_shape=list(padded["input_ids"].shape), packed_shape=list(packed["input_ids"].shape))
    losses = {}
    for name, batch, core in variants:
        model.set_attn_implementation(core)
        wall, cpu, loss = timed(model, batch, steps=steps, warmup=warmup, forward_only=forward_only)
        losses[name] = loss
        row[name] = dict(wall_s=wall, cpu_s=cpu, tokens_per_s=tokens / wall, tokens_per_cpu_s=tokens / cpu)
    model.set_attn_implementation("sdpa")
    for name, loss in losses.items():
        if abs(loss - losses["padded"]) > 1e-4:
            raise AssertionError(f"{name} loss {loss} differs from padded {losses['padded']}")
    row["loss"] = losses["padded"]
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--forward", action="store_true", help="forward passes only (adds packed through Flex)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = 2000
    model = build_model(vocab)
    rows = [run_cell(model, vocab, *cell, steps=args.steps, warmup=args.warmup, forward_only=args.forward)
            for cell in CELLS]
    names = ["padded", "packed"] + (["packed, flex"] if args.forward else [])
    print(f"{'docs':>4} {'lengths':>9} {'tokens':>6} {'padded rows':>12} {'packed rows':>12} "
          + " ".join(f"{n + ' tok/s':>18} {n + ' tok/CPU-s':>22}" for n in names))
    for row in rows:
        print(f"{row['documents']:>4} {str(row['lengths']):>9} {row['real_tokens']:>6} "
              f"{str(row['padded_shape']):>12} {str(row['packed_shape']):>12} "
              + " ".join(f"{row[n]['tokens_per_s']:>18,.0f} {row[n]['tokens_per_cpu_s']:>22,.0f}" for n in names))
    if args.json:
        meta = dict(torch=torch.__version__, transformers=transformers.__version__, machine=platform.processor() or
                    platform.machine(), threads=args.threads, steps=args.steps, warmup=args.warmup,
                    forward_only=args.forward, date=time.strftime("%Y-%m-%d"), load_average=os.getloadavg())
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(dict(meta=meta, rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
