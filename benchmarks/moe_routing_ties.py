"""Why the Mixtral's low-precision layouts drift from ``transformers``: router ties (issue 30).

    python benchmarks/moe_routing_ties.py [--tp 2] [--tokens 256] [--json moe_routing_ties.json]

The tiny Mixtral of the composition table (``composition.table.representative("mixtral")``) at tp ``--tp`` (gloo
processes) and single-process ``transformers`` from the same weights run one forward on the same batch under
``torch.autocast`` (bf16, then fp16). Forward hooks on both routers record, per layer, the chosen experts of every
token. Printed per dtype and layer: how many tokens the two sides route to different experts and, for those, the
gap between the reference's k-th and (k+1)-th router probabilities (0.0: a tie at that precision). The hidden
states reaching the router differ in the last bits (tp's row-parallel all-reduce sums partial products in another
order), so a token whose k-th and (k+1)-th choices are tied or within rounding can go to another expert: its
expert and router gradients then differ by a whole token's contribution, not by rounding, and AdamW turns that into
parameter differences of up to ~lr per step. In fp32 the same runs route identically (the zoo checks 1e-5).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _record(model, class_name: str) -> list:
    seen = []
    for module in model.modules():
        if type(module).__name__ == class_name:  # both routers return (logits, weights, expert index)
            module.register_forward_hook(lambda _m, _i, out: seen.append((out[0].detach().float(), out[2].detach())))
    return seen


def _compare(path: str, vocab: int, tp: int, tokens: int, out_json: str | None) -> None:
    import transformers

    import oslo_models as om

    batch = torch.randint(0, vocab, (max(1, tokens // 32), 32), generator=torch.Generator().manual_seed(0))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    ours = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=tp),
                                                   progress=False)
    theirs, mine = _record(reference, "MixtralTopKRouter"), _record(ours, "TopKRouter")
    rows = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        theirs.clear(), mine.clear()
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            reference(input_ids=batch), ours(input_ids=batch)
        for layer, ((logits, index), (_, our_index)) in enumerate(zip(theirs, mine)):
            top_k = index.shape[-1]
            differs = (index.sort(-1).values != our_index.sort(-1).values).any(-1)
            probs = logits.softmax(-1).sort(-1, descending=True).values
            gap = probs[:, top_k - 1] - probs[:, top_k]
            rows.append(dict(dtype=str(dtype).split(".")[-1], layer=layer, tokens=len(differs),
                             routed_differently=int(differs.sum()), their_gaps=gap[differs].tolist(),
                             median_gap=float(gap.median())))
    if int(os.environ.get("RANK", "0")) == 0:
        print("| dtype | layer | tokens | routed differently | k-th minus (k+1)-th probability there | median gap |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            gaps = ", ".join(f"{g:.2e}" for g in r["their_gaps"]) or "-"
            print(f"| {r['dtype']} | {r['layer']} | {r['tokens']} | {r['routed_differently']} | {gaps} | "
                  f"{r['median_gap']:.2e} |")
        if out_json:
            with open(out_json, "w", encoding="utf-8") as handle:
                json.dump({"tp": tp, "torch": torch.__version__, "rows": rows}, handle, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from oslo_models.composition.table import representative
    from tests.helpers.dist import run_distributed

    model_class, config = representative("mixtral")
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="oslo_moe_ties_")
    model_class.hf_twin(config).save_pretrained(path)
    run_distributed(_compare, args.tp, path, config.vocab_size, args.tp, args.tokens, args.json)


if __name__ == "__main__":
    main()
