"""Graph breaks of ``torch.compile`` over a training forward (loss included) of every native family.

    python benchmarks/compile_graph_breaks.py [--types gpt2 llama ...] [--tp 1 2] [--kernels]
        [--json benchmarks/compile_graph_breaks.json]

For each model type with a family record (``tests/helpers/zoo.py``: the record's tiny config, random weights from a
seed, saved in Hub format) the first of its causal-LM, masked-LM or seq2seq-LM classes is loaded at each
tensor-parallel size (gloo processes for tp > 1) and ``torch._dynamo.explain(model)(**batch, labels=...)`` counts
the graphs and graph breaks with each break's reason and place. ``--kernels`` sets ``OSLO_FUSED_OPS=force`` (needs
``TRITON_INTERPRET=1`` on CPU): the fused Triton ops then run inside the graph as ``torch.ops.oslo_models.*``
custom ops instead of the references the dispatcher picks under compile. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import oslo_models as om  # noqa: E402
from oslo_models.models.registry import family_record  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402
from tests.helpers.models import padded_batch  # noqa: E402
from tests.helpers.zoo import model_types, tiny_config  # noqa: E402

# task -> the Auto class that loads it; the first task a record has is used
TASKS = {"causal_lm": "AutoModelForCausalLM", "masked_lm": "AutoModelForMaskedLM",
         "seq2seq_lm": "AutoModelForSeq2SeqLM"}


def task_of(model_type: str) -> str | None:
    classes = family_record(model_type).classes
    return next((task for task in TASKS if task in classes), None)


def training_batch(task: str, vocab_size: int) -> tuple[dict, torch.Tensor]:
    """Right-padded rows of unequal lengths and their labels (-100 on padding; masked LM: also every other
    token; seq2seq: decoder labels of length 4)."""
    ids, mask, labels = padded_batch(vocab_size, batch=2, seq=8)
    if task == "masked_lm":
        return dict(input_ids=ids, attention_mask=mask), labels.masked_fill(torch.arange(8) % 2 == 1, -100)
    if task == "seq2seq_lm":
        dec_ids, dec_mask, dec_labels = padded_batch(vocab_size, batch=2, seq=4, seed=2)
        return dict(input_ids=ids, attention_mask=mask, decoder_attention_mask=dec_mask), dec_labels
    return dict(input_ids=ids, attention_mask=mask), labels


def save_tiny(model_type: str, folder: str) -> str:
    record = family_record(model_type)
    torch.manual_seed(0)
    record.model_class(task_of(model_type)).hf_twin(tiny_config(model_type)).save_pretrained(folder)
    return folder


def explain(model_type: str, path: str, tp: int) -> dict:
    task = task_of(model_type)
    torch._dynamo.reset()
    model = getattr(om, TASKS[task]).from_pretrained(
        path, parallel=om.ParallelConfig(tensor_parallel_size=tp), progress=False).train()
    inputs, labels = training_batch(task, model.config.vocab_size)
    start = time.perf_counter()
    result = torch._dynamo.explain(model)(**inputs, labels=labels)
    breaks = [{"reason": str(b.reason).splitlines()[0],
               "where": [f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}" for f in b.user_stack[-2:]]}
              for b in result.break_reasons]
    return {"model": model_type, "task": task, "tp": tp, "graphs": result.graph_count,
            "graph_breaks": result.graph_break_count, "seconds": round(time.perf_counter() - start, 1),
            "breaks": breaks}


def explain_all(paths: dict, tp: int, out_dir: str) -> None:
    rows = []
    for model_type, path in paths.items():
        try:
            rows.append(explain(model_type, path, tp))
        except Exception as error:  # a model that does not trace at all is a row too
            rows.append({"model": model_type, "task": task_of(model_type), "tp": tp, "graphs": None,
                         "graph_breaks": None, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}",
                         "breaks": []})
        print(f"[tp {tp}] {rows[-1]['model']}: {rows[-1]['graph_breaks']} breaks", flush=True)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        with open(os.path.join(out_dir, f"tp{tp}.json"), "w", encoding="utf-8") as handle:
            json.dump(rows, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=None, help="model types (default: every family record)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--kernels", action="store_true", help="OSLO_FUSED_OPS=force: the Triton ops in the graph")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.kernels:
        os.environ["OSLO_FUSED_OPS"] = "force"
    types = [t for t in (args.types or model_types()) if task_of(t) is not None]
    root = tempfile.mkdtemp()
    paths = {t: save_tiny(t, os.path.join(root, t)) for t in types}
    rows = []
    for tp in args.tp:
        if tp == 1:
            explain_all(paths, 1, root)
        else:
            run_distributed(explain_all, tp, paths, tp, root, timeout=3600)
        with open(os.path.join(root, f"tp{tp}.json"), encoding="utf-8") as handle:
            rows += json.load(handle)
    kernels = "kernels (OSLO_FUSED_OPS=force)" if args.kernels else "dispatcher default"
    print(f"torch.compile graph breaks, training forward + loss, torch {torch.__version__}, fused ops: {kernels}")
    print(f"{'model':<22}{'task':<12}{'tp':>3}{'graphs':>8}{'breaks':>8}")
    for row in rows:
        print(f"{row['model']:<22}{row['task']:<12}{row['tp']:>3}{str(row['graphs']):>8}{str(row['graph_breaks']):>8}"
              + (f"  {row['error']}" if row.get("error") else ""))
        for item in {(b["reason"], tuple(b["where"])) for b in row["breaks"]}:
            print(f"    {item[0]}  at {list(item[1])}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"torch": torch.__version__, "fused_ops": kernels, "date": time.strftime("%Y-%m-%d"),
                       "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
