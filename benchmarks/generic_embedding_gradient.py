"""Generic path: the vocabulary-split embedding's gradient per tp rank, kept whole (before) and as the rank's slice.

    python benchmarks/generic_embedding_gradient.py [--vocab 16000 --hidden 512 --layers 2 --tp 1 2 4]
                                                    [--json benchmarks/generic_embedding_gradient.json]

A random granite (a type with no native family; untied embedding; fp32) built by ``om.AutoModelForCausalLM
.from_config`` at each tp size in fresh ``torchrun`` processes (gloo, CPU). One forward and backward of a 4 x 128
batch, twice: with the generic path's slice hook taken off (``.grad`` as DTensor's embedding backward leaves it:
``Replicate``, the whole ``[V, h]`` on every rank) and with it (``generic/vocab_embedding.py``: the rank's
``Shard(0)`` rows). Per rank: the bytes of the embedding weight's local gradient and of all local gradients (exact
``nbytes``); the two runs' gradients are checked equal on the rank's rows. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(args) -> None:
    import torch
    import transformers

    import oslo_models as om
    from oslo_models.generic.vocab_embedding import SliceGradient

    config = transformers.GraniteConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                        intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ids = torch.randint(3, args.vocab, (4, 128), generator=torch.Generator().manual_seed(0))
    found = {}
    for kept in ("whole", "slice"):
        torch.manual_seed(0)
        model = om.AutoModelForCausalLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=args.tp))
        embedding = model.get_input_embeddings()
        if kept == "whole":
            for key, hook in list(embedding._forward_pre_hooks.items()):
                if isinstance(hook, SliceGradient):
                    del embedding._forward_pre_hooks[key]
        model(input_ids=ids, labels=ids).loss.backward()
        grad = embedding.weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        found[kept] = dict(embedding=local.nbytes, all=sum((p.grad.to_local() if hasattr(p.grad, "to_local")
                                                             else p.grad).nbytes for p in model.parameters()),
                           shape=list(local.shape), placements=str(getattr(grad, "placements", "plain")))
        found[kept + "_rows"] = local
    whole, rows = found.pop("whole_rows"), found.pop("slice_rows")
    if whole.shape != rows.shape:  # the slice equals the whole gradient's rows of this rank
        start = min(int(os.environ["RANK"]) * -(-args.vocab // args.tp), args.vocab)
        whole = whole[start:start + rows.shape[0]]
    found["max_abs_diff"] = float((whole - rows).abs().max())
    with open(os.path.join(args.out, f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump(found, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "generic_embedding_gradient.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.tp = args.tp[0]
        return _worker(args)
    results = []
    for tp in args.tp:
        with tempfile.TemporaryDirectory() as out:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}",
                            os.path.abspath(__file__), "--worker", "--out", out, "--tp", str(tp),
                            "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--layers", str(args.layers)],
                           check=True, env=env, cwd=ROOT)
            ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(tp)]
        results.append(dict(tp=tp, ranks=ranks))
    mib = 1 / 2 ** 20
    print("| tp | embedding grad MiB per rank, whole (before) | kept slice (after) | all grads MiB per rank, before "
          "| after | max abs diff |")
    print("|---|---|---|---|---|---|")
    for result in results:
        ranks = result["ranks"]
        print(f"| {result['tp']} | {max(r['whole']['embedding'] for r in ranks) * mib:.2f} | "
              f"{max(r['slice']['embedding'] for r in ranks) * mib:.2f} | "
              f"{max(r['whole']['all'] for r in ranks) * mib:.2f} | "
              f"{max(r['slice']['all'] for r in ranks) * mib:.2f} | "
              f"{max(r['max_abs_diff'] for r in ranks):.1e} |")
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  machine=platform.platform(), cpus=os.cpu_count(), vocab=args.vocab, hidden=args.hidden,
                  layers=args.layers, results=results)
    with open(args.json, "w") as handle:
        json.dump(record, handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
