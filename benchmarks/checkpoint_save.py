"""Save time and peak RSS per rank of the Hub export: the distributed writer vs the gathering save (issue 53).

    python benchmarks/checkpoint_save.py [--layers 12 --hidden 768 --vocab 32000] [--procs 2 4 8]
                                         [--json benchmarks/checkpoint_save.json]

Builds a random GPT-2 once (safetensors, saved locally), then for each process count N launches N fresh processes
with ``torchrun`` (gloo on CPU) at tp 2 x dp N/2, ZeRO-3, and measures on every rank, one after the other:

- ``distributed``: ``training.save_pretrained(model, out)`` (every rank writes its share, nothing gathered);
- ``model``: the model's own ``model.save_pretrained(out)`` (the same distributed writer);
- ``gathering``: ``training.save_pretrained(model, out, distributed=False)`` (the save before issue 53);
- ``consolidate``: the offline consolidation of a resumable checkpoint of the same model by the same N processes
  (``python -m oslo_models checkpoint consolidate`` under torchrun).

Peak RSS growth is ``oslo_models.utils.PeakRSS`` around the call (the kernel's high-water mark reset on entry, so
the resident model does not count; freed memory is handed back with ``malloc_trim`` before each call, so that a call
cannot hide in what an earlier one freed); seconds are the slowest rank's wall time of the call.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def worker(args) -> None:
    import ctypes
    import gc

    import torch.distributed as dist

    import oslo_models as om
    from oslo_models import training
    from oslo_models.conversion.consolidate import consolidate
    from oslo_models.utils import PeakRSS

    cfg = om.ParallelConfig(tensor_parallel_size=2, zero_stage=3)
    model = om.AutoModelForCausalLM.from_pretrained(args.path, parallel=cfg, progress=False)
    model, _ = training.shard_data_parallel(model)
    rows = {}
    for label, call in (
            ("distributed", lambda: training.save_pretrained(model, os.path.join(args.tmp, "new"))),
            ("model", lambda: training.unwrap_model(model).save_pretrained(os.path.join(args.tmp, "own"))),
            ("consolidate", lambda: consolidate(os.path.join(args.tmp, "ckpt"), os.path.join(args.tmp, "merged"))),
            ("gathering", lambda: training.save_pretrained(model, os.path.join(args.tmp, "old"), distributed=False))):
        if label == "consolidate":
            training.save_checkpoint(os.path.join(args.tmp, "ckpt"), model, step=1)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory freed earlier goes back: a save cannot hide in it
        dist.barrier()
        with PeakRSS() as peak:
            start = time.perf_counter()
            result = call()
            seconds = time.perf_counter() - start
        written = result.get("bytes") if isinstance(result, dict) else None
        rows[label] = {"peak_rss_growth_bytes": peak.growth_bytes, "seconds": seconds, "bytes_written": written}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(everyone, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--json", default="checkpoint_save.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import torch
    import transformers

    root = tempfile.mkdtemp(prefix="oslo-checkpoint-save-")
    path = os.path.join(root, "model")
    config = transformers.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                                     vocab_size=args.vocab, n_positions=512)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    del model
    model_bytes = os.path.getsize(os.path.join(path, "model.safetensors"))
    print(f"GPT-2 {num_params / 1e6:.1f}M parameters, {model_bytes / 2**20:.0f} MiB (fp32 safetensors); "
          "tp 2 x dp N/2, ZeRO-3, gloo on CPU")
    print(f"{'N':>3} {'save':<12}{'max peak RSS growth / rank':>28}{'x model':>9}{'slowest rank s':>16}"
          f"{'bytes written / rank (min-max)':>34}")
    results = []
    me = os.path.abspath(__file__)
    for procs in args.procs:
        tmp = os.path.join(root, f"n{procs}")
        os.makedirs(tmp)
        out = os.path.join(tmp, "rows.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}", me, "--worker",
                        "--path", path, "--tmp", tmp, "--out", out], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as handle:
            per_rank = json.load(handle)
        for label in ("distributed", "model", "gathering", "consolidate"):  # (measured: gathering last)
            group = [rank[label] for rank in per_rank]
            growth = max(row["peak_rss_growth_bytes"] for row in group)
            seconds = max(row["seconds"] for row in group)
            written = [row["bytes_written"] for row in group if row["bytes_written"] is not None]
            span = f"{min(written) / 2**20:.0f}-{max(written) / 2**20:.0f} MiB" if written else "rank 0: all"
            results.append({"procs": procs, "save": label, "max_peak_rss_growth_bytes": growth,
                            "ratio_to_model_bytes": growth / model_bytes, "max_seconds": seconds,
                            "per_rank": group})
            print(f"{procs:>3} {label:<12}{growth / 2**20:>24.0f} MiB{growth / model_bytes:>9.2f}{seconds:>16.2f}"
                  f"{span:>34}")
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump({"num_params": num_params, "model_bytes": model_bytes, "layout": "tp2 x dp N/2, ZeRO-3",
                   "results": results}, handle, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
