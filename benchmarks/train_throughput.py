"""End-to-end training throughput: this project against plain ``transformers`` (eager, ``torch.compile``, Liger).

    PYTHONPATH=. python benchmarks/train_throughput.py --device cpu [--json train_throughput.json]
    PYTHONPATH=. python benchmarks/train_throughput.py --device cuda --model gpt2 [--json ...]   # GPT-2 350M
    PYTHONPATH=. python benchmarks/train_throughput.py --device cuda --model llama                # Llama-1B class

Every variant trains the same model (random weights from one seed, copied into this project's model; Hub keys are
the same) on the same random token batches for the same number of AdamW steps, in a fresh subprocess (so peak
memory, compile caches and allocator state are its own). Dropout is off, so the final losses of all variants
must agree; they are printed as a check that every variant computes the same training.

Variants (``--variants`` picks a subset): ``transformers`` (eager, SDPA), ``transformers+compile``,
``transformers+liger`` and ``transformers+liger+compile`` (only where ``liger_kernel`` is installed and has the
model type; otherwise a row says why not), ``transformers+ckpt`` (its own ``gradient_checkpointing_enable()``),
``oslo`` (``ParallelConfig(fused_ops=True)``, tp=1), ``oslo+compile``, and ``oslo+ckpt:<mode>`` for every
``ParallelConfig.activation_checkpointing`` mode. ``partitioned`` needs tp > 1 and so is equal to ``full`` in this
one-process benchmark; it is left out (its 1/tp storage is tested in tests/models/test_activation_checkpointing.py).

Measured over ``--steps`` steps after ``--warmup`` steps (compilation happens in the warm-up): tokens/s and, for a
shared CPU box, tokens per CPU-second of the worker (one intra-op thread by default on CPU; the CPU ratio column
uses it, since wall time there measures the neighbours' load); MFU on
CUDA (model FLOPs ``6 N + 6 L s h`` per token, N the matmul parameters, recomputation not counted, over the bf16
dense peak of the GPU, ``--peak-tflops`` to override); peak memory (CUDA: ``max_memory_allocated`` over the
training steps, weights included; CPU: growth of the process's peak RSS over the training steps, weights
excluded, so optimizer state, gradients, activations and, for compile, the compiler's own memory, blurred by the
allocator's caching); the bytes of activations autograd keeps for the backward of one more forward (distinct
storages, parameters and offloaded host copies not counted; eager variants only); final loss.
For the offload mode the "expected" saving is the blocks' input hidden states, ``L * b * s * h`` elements.
CUDA runs in bf16 weights (AdamW on bf16 parameters, the same for every variant); CPU in fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = ("selective", "full", "offload")
VARIANTS = ("transformers", "transformers+compile", "transformers+liger", "transformers+liger+compile",
            "transformers+ckpt", "oslo", "oslo+compile") + tuple(f"oslo+ckpt:{mode}" for mode in MODES)
# name -> (config, batch, seq) per device
SHAPES = {
    ("gpt2", "cpu"): (dict(n_embd=256, n_layer=4, n_head=8, vocab_size=8192, n_positions=256), 4, 256),
    ("llama", "cpu"): (dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=8192, max_position_embeddings=256), 4, 256),
    # GPT-2 medium (350M)
    ("gpt2", "cuda"): (dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024), 8, 1024),
    # Llama 3.2 1B shape
    ("llama", "cuda"): (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
                             rope_theta=500000.0, tie_word_embeddings=True), 4, 2048),
}
BF16_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


def _config(model: str, device: str):
    import transformers

    values, batch, seq = SHAPES[(model, device)]
    if model == "gpt2":
        config = transformers.GPT2Config(**values, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
    else:
        config = transformers.LlamaConfig(**values)
    config._attn_implementation = "sdpa"
    return config, batch, seq


def _matmul_params(model, config) -> int:
    """Parameters that take part in a matmul per token: all but the embedding tables, plus the LM head."""
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return sum(p.numel() for p in model.parameters()) - embedding + config.vocab_size * config.hidden_size


def _build(variant: str, config, device: torch.device, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    with torch.device(device):  # random init where it runs (a 1B model initializes slowly on the host)
        model = transformers.AutoModelForCausalLM.from_config(config)
    if variant.startswith("oslo"):
        import oslo_models as om

        mode = variant.split("ckpt:")[1] if "ckpt:" in variant else None
        ours = om.AutoModelForCausalLM.from_config(
            config, parallel=om.ParallelConfig(fused_ops=True, activation_checkpointing=mode))
        ours.load_state_dict(model.state_dict())  # the same weights as the transformers variants
        model = ours
    elif "liger" in variant:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif variant == "transformers+ckpt":
        enable = getattr(model, "activation_checkpointing_enable", None)  # the newer name (transformers >= 5.2x)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = model.to(device=device, dtype=dtype).train()
    return model


def _peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in BF16_PEAK_TFLOPS.items() if key in name), None)


def run_variant(args) -> dict:
    """One variant in this process: build, warm up, time ``args.steps`` steps."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config, batch, seq = _config(args.model, args.device)
    batch = args.batch or batch
    seq = args.seq or seq
    model = _build(args.variant, config, device, dtype)
    n_matmul = _matmul_params(model, config)
    step_model = torch.compile(model) if "compile" in args.variant else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6, foreach=True)
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab_size, (args.warmup + args.steps, batch, seq), generator=generator)

    def step(ids):
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    from oslo_models.utils.memory import PeakRSS

    rss = PeakRSS().__enter__()
    for i in range(args.warmup):
        step(data[i].to(device))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(args.warmup, args.warmup + args.steps):
        loss = step(data[i].to(device))
    final_loss = loss.float().item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    rss.__exit__(None, None, None)
    tokens = args.steps * batch * seq
    layers, hidden = config.num_hidden_layers, config.hidden_size
    flops_per_token = 6 * n_matmul + 6 * layers * seq * hidden
    peak = _peak_tflops(device, args.peak_tflops)
    result = {"variant": args.variant, "model": args.model, "device": args.device, "batch": batch, "seq": seq,
              "steps": args.steps, "seconds": seconds, "tokens_per_s": tokens / seconds, "cpu_seconds": cpu_seconds,
              "tokens_per_cpu_s": tokens / cpu_seconds, "threads": torch.get_num_threads(), "final_loss": final_loss,
              "matmul_params": n_matmul, "block_inputs_bytes": layers * batch * seq * hidden * dtype.itemsize}
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        result["device_name"] = torch.cuda.get_device_name(device)
        if peak:
            result["mfu"] = tokens / seconds * flops_per_token / (peak * 1e12)
    else:
        result["peak_memory_bytes"] = rss.growth_bytes
    if args.profile and device.type == "cuda":
        result["profile"] = _profile(step, data[0].to(device))
    if "compile" not in args.variant:
        result["saved_activation_bytes"] = _saved_activation_bytes(model, data[0].to(device))
    return result


def _profile(step, ids, rows: int = 20) -> str:
    """The GPU kernels of two more training steps, by their own GPU time (where a variant's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(ids)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60)


def _saved_activation_bytes(model, ids) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for the backward of one forward: what
    checkpointing shrinks. Block inputs held by the offload mode (host copies) are not counted: they left the
    device. On CUDA this is what peak memory drops by; on CPU, where host and device are one memory, it is the
    only place the offload mode's effect shows."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and tensor.device == ids.device:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def _skip_reason(variant: str, model: str) -> str | None:
    if "liger" in variant:
        try:
            from liger_kernel.transformers import monkey_patch
        except ImportError:
            return "liger_kernel is not installed"
        if model not in getattr(monkey_patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", {}):
            return f"liger_kernel has no {model} kernels"
    return None


def _run_subprocess(args, variant: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--device", args.device,
               "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.profile:
        command.append("--profile")
    for name in ("batch", "seq", "peak_tflops", "threads"):
        if getattr(args, name):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"variant": variant, "model": args.model, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(rows: list[dict], device: str) -> str:
    """On CPU the ratio is of tokens per CPU-second of the (single-threaded) worker: on a shared box wall time
    measures the neighbours, CPU time the work. On CUDA it is of wall-clock tokens/s."""
    key = "tokens_per_cpu_s" if device == "cpu" else "tokens_per_s"
    lines = ["| model | variant | tokens/s | tokens/CPU-s | x transformers | MFU | peak memory MiB | saved activations "
             "MiB | final loss |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if key not in r:
            lines.append(f"| {r['model']} | {r['variant']} | skipped: {r.get('skipped') or r.get('error')} |||||||")
            continue
        base = next((b for b in rows if b["model"] == r["model"] and b["variant"] == "transformers" and key in b),
                    None)
        ratio = f"{r[key] / base[key]:.3f}" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        saved = f"{r['saved_activation_bytes'] / 2**20:.1f}" if "saved_activation_bytes" in r else "-"
        lines.append(f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:.0f} | {r['tokens_per_cpu_s']:.0f} | "
                     f"{ratio} | {mfu} | {r['peak_memory_bytes'] / 2**20:.0f} | {saved} | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("gpt2", "llama"), nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (cpu 6, cuda 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (cpu 2, cuda 3)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak for MFU")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the variant list this many times, interleaved; keep each variant's fastest run "
                             "(on a shared box the least disturbed one)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (cpu default 1)")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: after timing, print each variant's top GPU kernels over two more steps")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (10 if args.device == "cuda" else 6)
    args.warmup = args.warmup or (3 if args.device == "cuda" else 2)
    if args.worker:
        args.model = args.model[0]
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(run_variant(args)))
        return
    if args.device == "cpu" and not args.threads:
        args.threads = 1
    best: dict[tuple[str, str], dict] = {}
    for _ in range(args.repeat):
        for model in args.model:
            for variant in args.variants:
                reason = _skip_reason(variant, model)
                if reason:
                    best[(model, variant)] = {"variant": variant, "model": model, "skipped": reason}
                    continue
                row = _run_subprocess(argparse.Namespace(**{**vars(args), "model": model}), variant)
                print(json.dumps(row), file=sys.stderr, flush=True)
                kept = best.get((model, variant))
                key = "tokens_per_cpu_s" if args.device == "cpu" else "tokens_per_s"
                if kept is None or row.get(key, 0) > kept.get(key, 0):
                    best[(model, variant)] = row
    rows = list(best.values())
    for row in rows:
        if "profile" in row:
            print(f"## {row['model']} {row['variant']}: GPU kernels over two steps\n{row.pop('profile')}")
    print(_table(rows, args.device))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"device": args.device, "torch": torch.__version__, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
