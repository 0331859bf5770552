"""Generic path at tp 2: sequence parallelism against none and against ``transformers``' own tensor-parallel plan.

    python benchmarks/generic_sp.py [--hidden 512 --layers 4 --vocab 32000 --batch 2 --seq 512 --steps 3]
                                    [--json out.json]

A random granite (a type with no native family; fp32) trained at tp 2 in 2 fresh ``torchrun`` processes (gloo, CPU),
three ways, on the same batch:

- ``transformers' plan``: ``transformers``' class with its own plan applied by ``transformers``'
  ``apply_tensor_parallelism`` (what ``from_pretrained(tp_plan="auto")`` gives): the head's logits gathered to the
  whole vocabulary on both ranks, the loss computed on them;
- ``generic tp 2``: ``om.AutoModelForCausalLM`` at tp 2 (the vocabulary-parallel loss; layers on the whole sequence);
- ``generic tp 2 + SP``: the same with ``sequence_parallel=True`` (layers on half of the sequence).

Per rank and step (forward + backward, after one warm-up step): the bytes autograd saves for the backward (every
tensor packed by ``saved_tensors_hooks``, each storage once: the activation memory), the peak RSS growth over the step
(``oslo_models.utils.PeakRSS``) and the tokens of the batch per CPU-second of the process (``time.process_time``).
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("transformers' plan", "generic tp 2", "generic tp 2 + SP")


def _config(args):
    import transformers

    return transformers.GraniteConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=args.seq, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _build(variant: str, args):
    import torch
    import transformers

    import oslo_models as om

    torch.manual_seed(0)
    config = _config(args)
    if variant == VARIANTS[0]:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.configuration_utils import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        torch.distributed.init_process_group("gloo")
        model = transformers.GraniteForCausalLM(config)
        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
        apply_tensor_parallelism(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), plan)
        return model
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=variant == VARIANTS[2])
    return om.AutoModelForCausalLM.from_config(config, parallel=parallel)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from oslo_models.utils import PeakRSS

    model = _build(args.variant, args).train()
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    saved: dict[int, int] = {}

    def pack(tensor):
        local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
        storage = local.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    rows = []
    for step in range(args.steps + 1):
        saved.clear()
        with PeakRSS() as peak:
            start = time.process_time()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = model(ids, labels=ids).loss
            loss.backward()
            cpu = time.process_time() - start
        model.zero_grad(set_to_none=False)
        if step:  # the first one warms up
            rows.append({"saved_MiB": sum(saved.values()) / 2**20, "peak_rss_MiB": peak.growth_bytes / 2**20,
                         "tokens_per_cpu_second": args.batch * args.seq / cpu, "loss": float(loss)})
    mean = {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mean)
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(gathered, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("layers", 4), ("vocab", 32000), ("batch", 2), ("seq", 512),
                          ("steps", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json")
    parser.add_argument("--variant")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.variant:
        return worker(args)
    results = {}
    for variant in VARIANTS:
        out = os.path.join("/tmp", f"generic_sp_{VARIANTS.index(variant)}.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29613",
                   os.path.abspath(__file__), "--variant", variant, "--out", out,
                   *[f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "vocab", "batch", "seq", "steps")]]
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env, cwd=ROOT)
        with open(out, encoding="utf-8") as handle:
            results[variant] = json.load(handle)
    print("| variant | saved for backward (MiB / rank) | peak RSS growth (MiB / rank) | tokens / CPU-second / rank "
          "| loss |")
    print("|---|---:|---:|---:|---:|")
    for variant, ranks in results.items():
        mean = {key: sum(rank[key] for rank in ranks) / len(ranks) for key in ranks[0]}
        print(f"| {variant} | {mean['saved_MiB']:.1f} | {mean['peak_rss_MiB']:.1f} | "
              f"{mean['tokens_per_cpu_second']:.0f} | {mean['loss']:.6f} |")
    if args.json:
        record = {"command": " ".join(sys.argv), "machine": platform.platform(), "processor": platform.processor(),
                  "date": datetime.date.today().isoformat(), "args": {k: v for k, v in vars(args).items()
                                                                       if k not in ("variant", "out", "json")},
                  "results": results}
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
