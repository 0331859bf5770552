"""Peak host memory (RSS) and step time with the Adam state in memory vs on disk (``offload="nvme"``), and with
the ZeRO-3 parameter shards on disk too (``offload_params=True``).

    python benchmarks/nvme_offload.py [--n-embd 512] [--n-layer 8] [--steps 8] [--offload-path DIR] [--json out.json]

A GPT-2 whose optimizer state is most of its footprint (n_embd 512, 8 layers, vocab 8192: ~29M parameters; batch 1 x
32 tokens, so activations are negligible) trains ``--steps`` AdamW steps on the CPU, one rank, once with the state
in memory, once with ``ParallelConfig(offload="nvme")`` and once with ``offload_params=True`` as well (ZeRO-3 over a
one-rank gloo group, so that FSDP2's units hold the shards), each in a fresh process (``ru_maxrss`` is per process).
Reported per run: the peak RSS of the training steps (``VmHWM`` after resetting it once the model and optimizer are
built, so the peak of building the model does not hide them), the bytes of parameters, gradients and Adam moments,
the bytes of the rank's offload file, and the median step time (forward + backward + step) after the first step. The
saving should be close to the moments' bytes (2 x 4 bytes per parameter), less the step's two chunk buffers (16 MiB
of state each, or the largest parameter's state when it is larger: here the 8192 x 512 embedding's, 32 MiB). """
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2**20


def _status_bytes(key: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _child(args) -> dict:
    import torch
    import transformers

    import oslo_models as om
    from oslo_models import training

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    offload, zero3 = args.child != "none", args.child in ("z3nvme", "params")
    if zero3:  # ZeRO-3 over one rank: FSDP2's units hold the shards (that go to the file with offload_params)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1")
        torch.distributed.init_process_group("gloo")
    parallel = om.ParallelConfig(offload="nvme" if offload else None, zero_stage=3 if zero3 else 0,
                                 offload_path=args.offload_path if offload else None,
                                 offload_params=args.child == "params")
    config = transformers.GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=8, vocab_size=8192,
                                     n_positions=64)
    model = om.GPT2LMHeadModel.from_config(config, parallel=parallel).train()
    model, opt = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(0, 8192, (1, 32))
    # The peak of the training steps, not of building the model: reset the high-water mark (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as handle:
        handle.write("5")
    before = _status_bytes("VmRSS")
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients allocated: the steady state of a training loop
        times.append(time.perf_counter() - start)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    disk = getattr(opt, "file_bytes", 0) + getattr(getattr(opt, "parameter_file", None), "nbytes", 0)
    if offload:
        opt.close()
    return {"offload": args.child, "parameters": sum(p.numel() for p in model.parameters()),
            "param_bytes": params, "grad_bytes": params, "moment_bytes": 2 * params, "disk_bytes": disk,
            "rss_before_bytes": before, "peak_rss_bytes": _status_bytes("VmHWM"),
            "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s_median": statistics.median(times[1:]) if len(times) > 1 else times[0],
            "step_s": [round(t, 4) for t in times]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--offload-path", default=None, help="folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--port", type=int, default=29561, help="the one-rank process group's port (params mode)")
    parser.add_argument("--child", choices=["none", "nvme", "z3nvme", "params"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return
    path = args.offload_path or tempfile.mkdtemp(prefix="oslo_nvme_bench_")
    rows = []
    for mode in ("none", "nvme", "z3nvme", "params"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--n-embd", str(args.n_embd),
               "--n-layer", str(args.n_layer), "--steps", str(args.steps), "--threads", str(args.threads),
               "--offload-path", path, "--port", str(args.port)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base, nvme, z3nvme, params = rows
    print(f"GPT-2 n_embd={args.n_embd} n_layer={args.n_layer}: {base['parameters'] / 1e6:.1f}M parameters, "
          f"Adam moments {base['moment_bytes'] / MIB:.0f} MiB; {args.steps} steps, 1 rank, CPU, "
          f"{args.threads} thread(s)")
    print(f"{'optimizer state':<22} {'RSS before MiB':>15} {'peak RSS MiB':>13} {'on disk MiB':>12} "
          f"{'step s (median)':>16}")
    for row in rows:
        name = {"none": "in memory", "nvme": "nvme (disk)", "z3nvme": "zero3 + nvme",
                "params": "zero3 + nvme + params"}[row["offload"]]
        print(f"{name:<22} "
              f"{row['rss_before_bytes'] / MIB:>15.0f} {row['peak_rss_bytes'] / MIB:>13.0f} "
              f"{row['disk_bytes'] / MIB:>12.0f} {row['step_s_median']:>16.3f}")
    saved = base["peak_rss_bytes"] - nvme["peak_rss_bytes"]
    print(f"saved {saved / MIB:.0f} MiB of peak RSS = {saved / base['moment_bytes']:.0%} of the moments; step time "
          f"x{nvme['step_s_median'] / base['step_s_median']:.2f}")
    saved_params = z3nvme["peak_rss_bytes"] - params["peak_rss_bytes"]
    print(f"parameters on disk too (offload_params=True) against ZeRO-3 + nvme over one rank: saved "
          f"{saved_params / MIB:.0f} MiB of peak RSS (parameters: {base['param_bytes'] / MIB:.0f} MiB); step time "
          f"x{params['step_s_median'] / z3nvme['step_s_median']:.2f}")
    result = {"runs": rows, "saved_rss_bytes": saved, "offload_path": path, "saved_rss_bytes_params": saved_params,
              "step_time_ratio": nvme["step_s_median"] / base["step_s_median"],
              "step_time_ratio_params": params["step_s_median"] / z3nvme["step_s_median"]}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
