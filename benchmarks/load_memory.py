"""Per-rank peak RSS growth and wall time of ``from_pretrained`` at tp = 1, 2, 4 vs plain ``transformers``.

    python benchmarks/load_memory.py [--layers 10 --hidden 768 --vocab 32000] [--json load_memory.json]
    python benchmarks/load_memory.py --arch llama [--kv-heads 4 --intermediate 2048] [--json load_memory_llama.json]
    python benchmarks/load_memory.py --arch granite [--json load_memory_granite.json]   # the generic path

Builds a random GPT-2 (or, with ``--arch llama``, a Llama-shaped model: GQA, SwiGLU, untied embeddings; with ``--arch
granite``, a type with no native family, loaded by the generic path as ``transformers``' own class and split by its
``base_model_tp_plan``) once (safetensors, saved locally), then launches each measurement in fresh processes with
``torchrun`` (gloo on CPU) so imports and earlier loads do not pollute the numbers. Growth is measured with
``oslo_models.utils.PeakRSS`` around the load call only (the peak), and as the RSS right after it (what the rank
holds).
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
    import torch

    from oslo_models.utils import PeakRSS

    def rss() -> int:
        with open("/proc/self/status", encoding="ascii") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))

    if args.hf:
        import transformers

        with PeakRSS() as peak:
            start = time.perf_counter()
            model = transformers.AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.float32)
            seconds = time.perf_counter() - start
            held = rss() - peak.start_bytes  # while the model is alive
        rank = 0
    else:
        import oslo_models as om

        context = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=args.tp))
        auto = om.AutoModelForCausalLM  # names import lazily: import the model code before measuring
        auto.model_class_for(__import__("transformers").AutoConfig.from_pretrained(args.path))
        with PeakRSS() as peak:
            start = time.perf_counter()
            model = auto.from_pretrained(args.path, parallel=context, progress=False)
            seconds = time.perf_counter() - start
            held = rss() - peak.start_bytes  # while the model is alive
        rank = model.parallel_context.rank
    with open(args.out, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"rank": rank, "peak_rss_growth_bytes": peak.growth_bytes,
                                 "rss_after_load_bytes": held, "seconds": seconds}) + "\n")


def run(label: str, command: list[str], out: str) -> list[dict]:
    if os.path.exists(out):
        os.remove(out)
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL)
    return [dict(json.loads(line), label=label) for line in open(out, encoding="utf-8")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--arch", choices=("gpt2", "llama", "granite"), default="gpt2")
    parser.add_argument("--kv-heads", type=int, default=4, help="llama: key/value heads (GQA)")
    parser.add_argument("--intermediate", type=int, default=2048, help="llama: SwiGLU width")
    parser.add_argument("--json", default="load_memory.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import torch
    import transformers

    tmp = tempfile.mkdtemp(prefix="oslo-load-memory-")
    path = os.path.join(tmp, "model")
    if args.arch == "granite":  # no native family: the generic path
        config = transformers.GraniteConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                            intermediate_size=args.intermediate, vocab_size=args.vocab,
                                            max_position_embeddings=512, tie_word_embeddings=False)
    elif args.arch == "llama":
        config = transformers.LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                          intermediate_size=args.intermediate, vocab_size=args.vocab,
                                          max_position_embeddings=512, tie_word_embeddings=False)
    else:
        config = transformers.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                                         vocab_size=args.vocab, n_positions=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    del model
    model_bytes = os.path.getsize(os.path.join(path, "model.safetensors"))
    out = os.path.join(tmp, "rows.jsonl")
    me = os.path.abspath(__file__)
    rows = run("transformers", [sys.executable, me, "--worker", "--hf", "--path", path, "--out", out], out)
    for tp in (1, 2, 4):
        rows += run(f"oslo tp={tp}", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp),
                                      me, "--worker", "--tp", str(tp), "--path", path, "--out", out], out)
    summary = []
    print(f"{args.arch} {num_params / 1e6:.1f}M parameters, "
          f"checkpoint {model_bytes / 2**20:.0f} MiB (fp32 safetensors)")
    print(f"{'load':<16}{'ranks':>6}{'max peak RSS growth / rank':>29}{'x model':>9}{'held x model':>14}"
          f"{'max seconds':>13}")
    for label in dict.fromkeys(row["label"] for row in rows):
        group = [row for row in rows if row["label"] == label]
        growth = max(row["peak_rss_growth_bytes"] for row in group)
        seconds = max(row["seconds"] for row in group)
        held = max(row["rss_after_load_bytes"] for row in group)
        summary.append({"label": label, "ranks": len(group), "max_peak_rss_growth_bytes": growth,
                        "ratio_to_model_bytes": growth / model_bytes, "max_rss_after_load_bytes": held,
                        "max_seconds": seconds, "per_rank": group})
        print(f"{label:<16}{len(group):>6}{growth / 2**20:>25.0f} MiB{growth / model_bytes:>9.2f}"
              f"{held / model_bytes:>14.2f}{seconds:>13.2f}")
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump({"arch": args.arch, "num_params": num_params, "model_bytes": model_bytes, "results": summary}, handle,
                  indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
