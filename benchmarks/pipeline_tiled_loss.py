"""Peak host memory of a pipeline's last stage with and without ``ParallelConfig(tiled_loss=True)`` (issue 52).

    OMP_NUM_THREADS=1 python benchmarks/pipeline_tiled_loss.py [--seqs 1024 2048 4096] [--json FILE]

A Llama-shaped model (hidden 256, 4 layers, vocabulary 32000) at pp 2 (1F1B, 2 microbatches of one row each) on 2
gloo processes (fresh ones per cell). Each process runs one warm-up ``train_step`` + AdamW step at 128 tokens (the
optimizer state exists from then on), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), then runs one
``train_step`` + AdamW step at ``s`` tokens. Reported per stage: the step's peak RSS above the RSS before it (MiB),
the step's wall time and the loss (equal with and without the option: the same weights and tokens). Without the
option the last stage keeps each microbatch's ``[s, 32000]`` fp32 logits (and their softmax gradient); with it the
head and the cross-entropy run in row chunks. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, WARMUP_SEQ = 32000, 128


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _worker(rank: int, port: int, seq: int, tiled: bool, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import oslo_models as om

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=max(seq, 4096))
    torch.manual_seed(0)
    parallel = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=2, tiled_loss=tiled)
    model = om.LlamaForCausalLM.from_config(config, parallel=parallel).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(length: int) -> float:
        ids = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        loss = model.train_step({"input_ids": ids, "labels": ids})
        optimizer.step(), optimizer.zero_grad(set_to_none=True)
        return float(loss)

    step(WARMUP_SEQ)
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM (the peak RSS) to the current RSS
    start = time.perf_counter()
    loss = step(seq)
    row = dict(seq=seq, tiled_loss=tiled, stage=rank, step_peak_mib=(_status("VmHWM") - baseline) / 2 ** 20,
               seconds=time.perf_counter() - start, loss=loss)
    with open(f"{out}.{rank}", "w", encoding="utf-8") as handle:
        json.dump(row, handle)
    dist.barrier()
    dist.destroy_process_group()


def cell(seq: int, tiled: bool) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "row")
        mp.spawn(_worker, args=(port, seq, tiled, out), nprocs=2, join=True)
        rows = []
        for rank in range(2):
            with open(f"{out}.{rank}", encoding="utf-8") as handle:
                rows.append(json.load(handle))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| tokens | tiled_loss | stage | step peak RSS (MiB) | step s | loss |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['seq']} | {r['tiled_loss']} | {r['stage']} | {r['step_peak_mib']:.0f} | {r['seconds']:.1f} | "
              f"{r['loss']:.5f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = [row for seq in args.seqs for tiled in (False, True) for row in cell(seq, tiled)]
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
