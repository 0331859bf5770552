"""Per-rank bytes of parameters + gradients + optimizer state at each ZeRO stage, next to the ZeRO paper's formula.

    python benchmarks/zero_memory.py [--dp 2 4] [--json zero_memory.json]

A GPT-2 (n_embd 256, 4 layers, vocab 4096: Psi ~ 4.3M parameters) trains one AdamW step at tp=1 x dp=N on CPU
(gloo); each rank then sums the bytes of the tensors it holds: its parameters (FSDP2: its dim-0 shard), its
``.grad`` tensors and its optimizer state (ZeRO-1: only the partition it owns). DDP's communication buckets and
activations are not counted (the paper's model-state accounting does not count them either).

Formula. The paper counts mixed-precision Adam: 2Psi fp16 params + 2Psi fp16 grads + K=12 Psi (fp32 master, m, v):
16Psi; stage 1: 4Psi + 12Psi/N; stage 2: 2Psi + 14Psi/N; stage 3: 16Psi/N. These runs are fp32 (no separate master
copy): 4Psi params + 4Psi grads + K=8 Psi (m, v) = 16Psi, so the same partitioning gives: stage 0: 16Psi; stage 1:
8Psi + 8Psi/N; stage 2: 4Psi + 12Psi/N; stage 3: 16Psi/N. "fp32 formula" below is that; "paper" is the original.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGES = (0, 1, 2, 3)


def _bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _measure(stage: int) -> dict:
    import transformers

    import oslo_models as om
    from oslo_models import training

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=4096, n_positions=64)
    model = om.GPT2LMHeadModel.from_config(config, parallel=om.ParallelConfig()).train()
    psi = sum(p.numel() for p in model.parameters())
    model, opt = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                              zero_stage=stage)
    ids = torch.randint(0, 4096, (2, 64))
    model(ids, labels=ids).loss.backward()
    opt.step()
    inner = training.unwrap_model(model)
    params = sum(_bytes(p) for p in inner.parameters())
    grads = sum(_bytes(p.grad) for p in inner.parameters() if p.grad is not None)
    holder = getattr(opt, "optim", opt)
    state = sum(_bytes(v) for s in holder.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"psi": psi, "params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    results = {stage: _measure(stage) for stage in STAGES}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"dp{dist.get_world_size()}.json"), "w") as handle:
            json.dump(gathered, handle)


def formulas(psi: int, n: int) -> dict:
    fp32 = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    return {"fp32": fp32, "paper": paper}


def main() -> None:
    import tempfile

    from tests.helpers.dist import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", default="zero_memory.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.dp:
            run_distributed(_worker, n, tmp)
            with open(os.path.join(tmp, f"dp{n}.json")) as handle:
                per_rank = json.load(handle)
            for stage in STAGES:
                measured = [r[str(stage)] for r in per_rank]
                psi = measured[0]["psi"]
                f = formulas(psi, n)
                worst = max(m["total"] for m in measured)
                rows.append({"dp": n, "zero_stage": stage, "psi": psi, "max_rank_bytes": worst,
                             "per_rank_bytes": [m["total"] for m in measured],
                             "params": measured[0]["params"], "grads": measured[0]["grads"],
                             "optimizer": measured[0]["optimizer"],
                             "fp32_formula": f["fp32"][stage], "paper_formula_mixed_precision": f["paper"][stage],
                             "ratio_to_fp32_formula": worst / f["fp32"][stage]})
    print(f"{'dp':>3} {'stage':>5} {'max MiB/rank':>13} {'fp32 formula':>13} {'ratio':>6} {'paper (mp) MiB':>15}")
    for r in rows:
        print(f"{r['dp']:>3} {r['zero_stage']:>5} {r['max_rank_bytes'] / 2**20:>13.2f} "
              f"{r['fp32_formula'] / 2**20:>13.2f} {r['ratio_to_fp32_formula']:>6.3f} "
              f"{r['paper_formula_mixed_precision'] / 2**20:>15.2f}")
    with open(args.json, "w") as handle:
        json.dump({"rows": rows, "machine": "2-core CPU sandbox, gloo", "torch": torch.__version__}, handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
