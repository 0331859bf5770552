"""Peak memory of an LM head's loss: fused, chunked linear cross-entropy vs ``F.linear`` + ``F.cross_entropy``.

    python benchmarks/linear_ce_memory.py [--tokens 2048] [--hidden 768] [--vocab 50257] [--json out.json]

Each variant runs forward + backward once in a fresh process (so one variant's freed pages cannot hide the next
one's) and reports the peak RSS growth over that step (``oslo_models.utils.PeakRSS``), with the inputs, weight
and their gradients allocated before the measured block:

- ``unfused``: ``transformers``' head: ``logits = hidden @ W.T`` then ``F.cross_entropy`` (the ``[tokens, V]``
  logits, their softmax and their gradient exist at once);
- ``fused``: ``fused_ops.linear_cross_entropy_loss``, the loss-only path of every LM/MLM head
  (``skip_logits=True``): chunks of rows, so only one chunk's logits and gradient exist at a time.
- ``model``/``model_skip_logits``: a small GPT-2 (2 layers, n_embd 64, the same vocab, ``--tokens`` long)
  one training step with and without ``skip_logits``.

On CPU both run plain torch (the chunked path uses the torch stats/grad functions; the Triton kernels are a GPU
matter). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("unfused", "fused", "model", "model_skip_logits")


def _measure(variant: str, tokens: int, hidden: int, vocab: int) -> dict:
    sys.path.insert(0, ROOT)
    import torch
    import torch.nn.functional as F

    from oslo_models import fused_ops
    from oslo_models.utils.memory import PeakRSS

    torch.manual_seed(0)
    if variant.startswith("model"):
        import transformers

        import oslo_models as om

        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=tokens)
        model = om.GPT2LMHeadModel(config).train()
        ids = torch.randint(0, vocab, (1, tokens))
        for p in model.parameters():  # grads allocated up front: the block measures activations and logits
            p.grad = torch.zeros_like(p)
        with PeakRSS() as peak:
            out = model(input_ids=ids, labels=ids, skip_logits=variant == "model_skip_logits")
            out.loss.backward()
        return {"variant": variant, "peak_growth_mib": peak.growth_bytes / 2**20, "loss": out.loss.item()}
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (0.02 * torch.randn(vocab, hidden)).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,))
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    with PeakRSS() as peak:
        if variant == "unfused":
            loss = F.cross_entropy(F.linear(h, w), labels)
        else:
            loss = fused_ops.linear_cross_entropy_loss(h, w, labels)
        loss.backward()
    return {"variant": variant, "peak_growth_mib": peak.growth_bytes / 2**20, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--json", default=None)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measurement (child process)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(_measure(args.variant, args.tokens, args.hidden, args.vocab)))
        return
    rows = []
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens),
                              "--hidden", str(args.hidden), "--vocab", str(args.vocab)],
                             check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} fp32; one [tokens, vocab] fp32 tensor = "
          f"{logits_mib:.0f} MiB")
    print(f"{'variant':<20}{'peak growth MiB':>16}{'loss':>10}")
    for row in rows:
        print(f"{row['variant']:<20}{row['peak_growth_mib']:>16.0f}{row['loss']:>10.4f}")
    by = {row["variant"]: row["peak_growth_mib"] for row in rows}
    ratios = {"fused/unfused": by["fused"] / by["unfused"],
              "model skip_logits/model": by["model_skip_logits"] / by["model"]}
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rows": rows, "ratios": ratios, "tokens": args.tokens, "hidden": args.hidden,
                       "vocab": args.vocab, "machine": platform.platform(), "cpu_count": os.cpu_count(),
                       "date": datetime.date.today().isoformat()}, handle, indent=2)


if __name__ == "__main__":
    main()
