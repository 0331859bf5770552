"""Graph breaks of ``torch.compile`` over a whole training forward (loss included) of each family, at tp 1 and 2.

    python benchmarks/compile_graph_breaks.py [--tp 1 2] [--json compile_graph_breaks.json]

Tiny GPT-2 / BERT (MLM) / T5 v1.1 (gated GELU) / Llama checkpoints built from a seed, loaded at each
tensor-parallel size (gloo processes for tp > 1), then ``torch._dynamo.explain(model)(**batch, labels=...)``
with and without ``skip_logits``. Prints one row per (model, tp, skip_logits) with the graph and break counts and
each break's reason and place; writes JSON. Dropout is 0 in these models (see docs/fused-ops.md, "torch.compile").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import transformers  # noqa: E402

import oslo_models as om  # noqa: E402
from tests.helpers import decoders  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402
from tests.helpers.encoders import mlm_batch, save_tiny, save_tiny_t5, seq2seq_batch, tiny_bert_config  # noqa: E402
from tests.helpers.models import padded_batch, save_tiny_gpt2  # noqa: E402


def causal_batch():
    ids, mask, labels = padded_batch(101)
    return dict(input_ids=ids, attention_mask=mask), labels


MODELS = {"gpt2": ("AutoModelForCausalLM", causal_batch), "bert": ("AutoModelForMaskedLM", mlm_batch),
          "t5": ("AutoModelForSeq2SeqLM", seq2seq_batch), "llama": ("AutoModelForCausalLM", causal_batch)}


def explain_all(paths: dict, tp: int, out_dir: str) -> None:
    rows = []
    for name, path in paths.items():
        auto, batch = MODELS[name]
        for skip_logits in (False, True):
            torch._dynamo.reset()
            model = getattr(om, auto).from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=tp),
                                                      progress=False).train()
            inputs, labels = batch()
            result = torch._dynamo.explain(model)(**inputs, labels=labels, skip_logits=skip_logits)
            breaks = [{"reason": str(b.reason).splitlines()[0],
                       "where": [f"{f.filename}:{f.lineno}" for f in b.user_stack[-3:]]} for b in result.break_reasons]
            rows.append({"model": name, "tp": tp, "skip_logits": skip_logits, "graphs": result.graph_count,
                         "graph_breaks": result.graph_break_count, "breaks": breaks})
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        with open(os.path.join(out_dir, f"tp{tp}.json"), "w", encoding="utf-8") as handle:
            json.dump(rows, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    paths = {"gpt2": save_tiny_gpt2(os.path.join(root, "gpt2")),
             "bert": save_tiny(os.path.join(root, "bert"), transformers.BertForMaskedLM, tiny_bert_config()),
             "t5": save_tiny_t5(os.path.join(root, "t5"), gated=True),
             "llama": decoders.save_tiny(os.path.join(root, "llama"), "llama")}
    rows = []
    for tp in args.tp:
        if tp == 1:
            explain_all(paths, 1, root)
        else:
            run_distributed(explain_all, tp, paths, tp, root, timeout=1200)
        with open(os.path.join(root, f"tp{tp}.json"), encoding="utf-8") as handle:
            rows += json.load(handle)
    print(f"{'model':<8}{'tp':>4}{'skip_logits':>13}{'graphs':>8}{'breaks':>8}")
    for row in rows:
        print(f"{row['model']:<8}{row['tp']:>4}{str(row['skip_logits']):>13}{row['graphs']:>8}{row['graph_breaks']:>8}")
        for item in row["breaks"]:
            print(f"    {item['reason']}  at {item['where']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"torch": torch.__version__, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
