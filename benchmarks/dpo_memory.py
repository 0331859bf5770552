"""Per-rank peak memory of one DPO step: vocabulary-parallel log-probabilities vs TRL's full-logits path.

    python benchmarks/dpo_memory.py [--vocab 32000 --hidden 128 --layers 2 --pairs 4 --seq 256] [--json out.json]

One DPO step = the policy's forward and backward plus the frozen reference's forward (no grad), on the same Llama
(random, fp32, saved once) and the same batch of ``--pairs`` chosen/rejected pairs of ``--seq`` tokens. Each variant
runs in fresh processes (``torchrun``, gloo on CPU); the figure is each rank's peak RSS growth over the step
(``oslo_models.utils.PeakRSS``), with the models loaded and the parameters' ``.grad`` buffers allocated before:

- ``vocab-parallel``: ``om.post_training.dpo_objective`` (``gather_logits=False``, ``om.losses``: each rank holds
  ``[tokens, V/tp]`` logits and one fp32 chunk at a time);
- ``full-logits (TRL)``: the same models and loss with the logits gathered to ``[tokens, V]`` on every rank and
  scored by TRL's own ``selective_log_softmax`` (what TRL's trainers did before their fused head, and what a tp
  model gives TRL unless its head is replaced).

Prints a table and writes JSON.
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


def _batch(vocab: int, pairs: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2 * pairs, seq), generator=g)
    completion = torch.zeros_like(ids)
    completion[:, seq // 4:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}


def _full_logits_objective(model, batch, *, reference, beta):
    """DPO on gathered logits scored by TRL's ``selective_log_softmax``."""
    import torch
    import torch.nn.functional as F
    from trl.trainer.utils import selective_log_softmax

    def logps(m):
        logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        per_token = selective_log_softmax(logits[:, :-1], batch["input_ids"][:, 1:])
        return (per_token * batch["completion_mask"][:, 1:]).sum(-1)

    policy = logps(model)
    with torch.no_grad():
        ref = logps(reference)
    chosen, rejected = (policy - ref).chunk(2)
    return -F.logsigmoid(beta * (chosen - rejected)).mean(), {}


def worker(args) -> None:
    sys.path.insert(0, ROOT)
    import torch

    import oslo_models as om
    from oslo_models.utils import PeakRSS

    context = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=args.tp[0]))
    model = om.AutoModelForCausalLM.from_pretrained(args.path, parallel=context, progress=False).train()
    reference = om.AutoModelForCausalLM.from_pretrained(args.path, parallel=context, progress=False).eval()
    for param in model.parameters():  # the gradients allocated up front: the block measures logits and activations
        param.grad = torch.zeros_like(param)
    batch = _batch(model.config.vocab_size, args.pairs, args.seq)
    objective = om.post_training.dpo_objective if args.variant == "vocab-parallel" else _full_logits_objective
    with PeakRSS() as peak:
        loss, _ = objective(model, batch, reference=reference, beta=0.1)
        loss.backward()
    with open(args.out, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"rank": context.rank, "peak_rss_growth_bytes": peak.growth_bytes,
                                 "loss": loss.item()}) + "\n")


def run(variant: str, tp: int, path: str, args, out: str) -> list[dict]:
    if os.path.exists(out):
        os.remove(out)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp), os.path.abspath(__file__),
               "--worker", "--variant", variant, "--tp", str(tp), "--path", path, "--out", out,
               "--pairs", str(args.pairs), "--seq", str(args.seq)]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in open(out, encoding="utf-8")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=4, help="chosen/rejected pairs (2x rows)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", default="dpo_memory.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import torch
    import transformers

    tmp = tempfile.mkdtemp(prefix="oslo-dpo-memory-")
    path = os.path.join(tmp, "model")
    config = transformers.LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=2 * args.hidden, vocab_size=args.vocab,
                                      max_position_embeddings=max(512, args.seq), tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    out = os.path.join(tmp, "rows.jsonl")
    tokens = 2 * args.pairs * args.seq
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; {args.pairs} pairs x {args.seq} "
          f"tokens ({tokens} tokens per step); one [tokens, V] fp32 tensor = {tokens * args.vocab * 4 / 2**20:.0f} MiB")
    print(f"{'variant':<20}{'tp':>4}{'max peak growth / rank':>25}{'loss':>10}")
    results = []
    for tp in args.tp:
        for variant in ("full-logits (TRL)", "vocab-parallel"):
            rows = run(variant, tp, path, args, out)
            growth = max(row["peak_rss_growth_bytes"] for row in rows)
            results.append({"variant": variant, "tp": tp, "max_peak_rss_growth_bytes": growth,
                            "loss": rows[0]["loss"], "per_rank": rows})
            print(f"{variant:<20}{tp:>4}{growth / 2**20:>21.0f} MiB{rows[0]['loss']:>10.5f}")
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "cpu": platform.processor(),
            "command": " ".join(sys.argv), "vocab": args.vocab, "hidden": args.hidden, "layers": args.layers,
            "pairs": args.pairs, "seq": args.seq}
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump({**meta, "results": results}, handle, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
