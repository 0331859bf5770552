"""Side by side with the peers: this project against what a user would run instead, at the same layout.

    PYTHONPATH=. python benchmarks/peers.py [--quick] [--models llama gpt2] [--sizes tiny small medium large]
                                            [--layouts tp2 tp4 dp2 tp2dp2] [--no-sp] [--profile DIR] [--json F]

Pairs (ours vs theirs), each in one spawned process group (``tests.helpers.dist.run_distributed``: the torchrun
environment, one intra-op thread per rank; gloo on CPU, NCCL on CUDA):

- ``tp2`` / ``tp4``: ``ParallelConfig(tensor_parallel_size=N, sequence_parallel=True)`` vs ``transformers``' own
  tensor parallelism (``from_pretrained(path, distributed_config=DistributedConfig(tp_size=N))``, the model's
  ``base_model_tp_plan`` on DTensors; the successor of ``tp_plan="auto"``; no sequence parallelism there:
  ``enable_sequence_parallel`` is "not wired up yet" in 5.24). GPT-2 has no ``base_model_tp_plan`` in
  ``transformers`` (Conv1D weights), so its tp rows have no peer.
- ``dp2``: ZeRO-3 here (``training.shard_data_parallel(zero_stage=3)``: FSDP2, one unit per block from
  ``_no_split_modules``, root unit unresharded) vs FSDP2 ``fully_shard`` on the ``transformers`` model with the
  same granularity (each decoder layer ``reshard_after_forward=True``, then the root).
- ``tp2dp2``: tp 2 (+SP) x ZeRO-3 over dp 2 here vs ``transformers``' own 2D layout
  (``DistributedConfig(tp_size=2, fsdp_size=2)``: tp plan on the mesh's ``tp`` axis, FSDP2 by the model's
  ``fsdp_plan`` on ``fsdp``: embeddings, each layer, the (norm, head) tail, root; what Accelerate's
  ``ParallelismConfig`` builds).

Both sides load one checkpoint (random weights from one seed, saved by ``transformers``), train on the same token
batches (global ``batch x seq`` per step; dp rank ``d`` takes rows ``d::dp``, tp ranks the same rows) with AdamW
(same hyperparameters), dropout off, fp32 on CPU. Windows of ``--steps`` steps alternate between the sides
(A, B, A, B, ... ``--rounds`` each, after ``--warmup`` untimed steps each), both models living in the same ranks, so
a neighbour's load on the shared box hits both alike; the median window is reported. Each side trains on its own
copy, so the per-step losses (mean over dp replicas) of the two must agree: ``max |dloss|`` over every step is the
parity check that makes the comparison fair (``LOSS_ATOL``; a pair that misses it is flagged ``MISMATCH``).

Measured per side: tokens/s (global tokens per wall second, the slowest rank's window), tokens per CPU-second
(global tokens over the CPU seconds of all ranks together: on a shared 2-core box wall time also measures the
neighbours, and tp4 runs 4 ranks on 2 cores), and per-rank tracked memory, the max over ranks of: ``state``
(bytes of this rank's local parameters + gradients + optimizer state, DTensors by their local shard, taken at the
end of a step before the gradients are dropped) and ``activations`` (bytes of the distinct storages autograd keeps
for the backward of one step, measured when the forward ends, so FSDP's resharded parameters count 0 and
parameters do not count). RSS is not used: both sides live in one process. On CUDA (never run here): bf16
weights, NCCL, Liger-Kernel on the ``transformers`` side when installed, ``torch.cuda.max_memory_allocated`` and
MFU from ``6 N + 6 L s h`` FLOPs per token (``--peak-tflops``, else H100/H200/A100 by name).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOSS_ATOL = 1e-4  # fp32; per-step losses after a few AdamW steps differ only by reduction order (~1e-6)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)
# name -> (tp, dp)
LAYOUTS = {"tp2": (2, 1), "tp4": (4, 1), "dp2": (1, 2), "tp2dp2": (2, 2)}
# (model, size) -> (config values, global batch, seq). Head counts divide 4 so both sides run tp4 unreplicated.
SIZES = {
    ("llama", "tiny"): (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=512, max_position_embeddings=256), 4, 64),
    ("llama", "small"): (dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=4, vocab_size=8192, max_position_embeddings=512), 4, 256),
    ("llama", "medium"): (dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                               num_key_value_heads=4, vocab_size=16384, max_position_embeddings=512), 4, 256),
    # the Llama-3.2-1B shape and GPT-2 medium (350M): for a GPU
    ("llama", "large"): (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
                           rope_theta=500000.0, tie_word_embeddings=True), 8, 2048),
    ("gpt2", "tiny"): (dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=256), 4, 64),
    ("gpt2", "small"): (dict(n_embd=256, n_layer=4, n_head=8, vocab_size=8192, n_positions=512), 4, 256),
    ("gpt2", "medium"): (dict(n_embd=512, n_layer=8, n_head=8, vocab_size=16384, n_positions=512), 4, 256),
    ("gpt2", "large"): (dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024), 8, 1024),
}
BF16_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


def make_config(model: str, size: str):
    import transformers

    values = SIZES[(model, size)][0]
    if model == "gpt2":
        return transformers.GPT2Config(**values, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0)
    return transformers.LlamaConfig(**values, attention_dropout=0.0)


def save_checkpoint(model: str, size: str, path: str, seed: int = 0) -> None:
    """The one checkpoint both sides load: ``transformers``' random init from ``seed``, in Hub format."""
    import transformers

    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(make_config(model, size)).save_pretrained(path)


def peer_missing(model: str, layout: str) -> str | None:
    """Why ``transformers`` has no peer for this pair (``None`` when it has one)."""
    import transformers

    tp, _ = LAYOUTS[layout]
    config_class = transformers.AutoConfig.for_model(model).__class__
    if tp > 1 and not getattr(config_class, "base_model_tp_plan", None):
        return f"transformers has no tensor-parallel plan for {model} (no base_model_tp_plan)"
    return None


# ---------------------------------------------------------------------------------------------- inside each rank


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _nbytes(tensor) -> int:
    tensor = _local(tensor)
    return tensor.numel() * tensor.element_size()


class _Side:
    """One model + optimizer on this rank, and the slice of each global batch it trains on."""

    def __init__(self, name: str, model, optimizer, rows: slice, mean_over_dp):
        self.name, self.model, self.optimizer, self.rows = name, model, optimizer, rows
        self.mean_over_dp = mean_over_dp  # this rank's loss -> the global batch's (a collective: every rank calls)
        self.losses: list[float] = []
        self.windows: list[tuple[float, float]] = []  # (wall s, CPU s) of this rank per timed window

    def step(self, ids: torch.Tensor) -> None:
        ids = ids[self.rows]
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()  # a DTensor loss
        self.losses.append(self.mean_over_dp(loss.float()))


def _build_ours(path: str, tp: int, dp: int, device: str, dtype, sequence_parallel: bool = True):
    import oslo_models as om
    from oslo_models import training

    config = om.ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
                               data_parallel_size=dp,
                               zero_stage=3 if dp > 1 else 0)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=config, dtype=dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    model, optimizer = training.shard_data_parallel(model, optimizer, zero_stage=config.zero_stage)
    return model, optimizer, model_dp_rank(model)


def model_dp_rank(model) -> int:
    from oslo_models import training

    return training.unwrap_model(model).parallel_context.dp_rank


def _build_theirs(path: str, tp: int, dp: int, device: str, dtype, liger: bool):
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    if tp > 1:  # transformers' own TP (and, with dp, its own FSDP2 on the fsdp axis of the same mesh)
        kwargs["distributed_config"] = DistributedConfig(tp_size=tp, fsdp_size=dp)
    elif device == "cuda":
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).train()
    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    if tp == 1 and dp > 1:  # FSDP2 by hand, the granularity of ZeRO-3 here: each decoder layer, then the root
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (dp,), mesh_dim_names=("dp",))
        for layer in model.base_model.h if hasattr(model.base_model, "h") else model.base_model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    dp_rank = dist.get_rank() // tp  # both meshes put tp innermost (ranks of one tp group adjacent)
    return model, optimizer, dp_rank


def _state_bytes(model, optimizer) -> int:
    params = list(model.parameters())
    state = sum(_nbytes(v) for s in getattr(optimizer, "state", {}).values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return sum(_nbytes(p) for p in params) + sum(_nbytes(p.grad) for p in params if p.grad is not None) + state


def _measure_memory(side: _Side, ids: torch.Tensor, device: str) -> dict:
    """Tracked bytes of one more (untimed) training step on this rank; see the module docstring."""
    params = {_local(p).untyped_storage().data_ptr() for p in side.model.parameters()}
    storages: dict[int, object] = {}

    def pack(tensor):
        try:
            storage = _local(tensor).untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
            pass
        return tensor

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    local = ids[side.rows]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = side.model(input_ids=local, labels=local).loss
    activations = sum(storage.nbytes() for storage in storages.values())  # when the forward ends
    storages.clear()
    loss.backward()
    side.optimizer.step()
    state = _state_bytes(side.model, side.optimizer)
    side.optimizer.zero_grad(set_to_none=True)
    out = {"state_bytes": state, "activation_bytes": activations}
    if device == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return out


def _profile(sides, data, data_of, index: int, device: str, spec: dict) -> None:
    """Rank 0 only (the other ranks run the step unprofiled, so the collectives still meet): one more step of each
    side under ``torch.profiler``, the top ops by self CPU time written to ``<profile>/<pair>-<side>.txt``."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(spec["profile"], exist_ok=True)
    for number, side in enumerate(sides):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            side.step(data[data_of[number]][index].to(device))
        name = f"{spec['model']}-{spec['size']}-{spec['layout']}-{side.name}.txt"
        with open(os.path.join(spec["profile"], name), "w") as handle:
            handle.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def _worker(specs: list[dict]) -> None:
    """Every pair of one world size in one process group (spawning is the slow part on a shared box)."""
    import gc

    for spec in specs:
        _run_pair(spec, spec["out"])
        gc.collect()


def _run_pair(spec: dict, out_path: str) -> None:
    import torch.distributed as dist

    device = spec["device"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tp, dp = LAYOUTS[spec["layout"]]
    model, optimizer, dp_rank = _build_ours(spec["path"], tp, dp, device, dtype, spec.get("sequence_parallel", True))
    world = dist.get_world_size()
    batch, seq = spec["batch"], spec["seq"]

    def mean_over_dp(loss: torch.Tensor) -> float:  # every rank holds its replica's loss; tp ranks alike
        total = loss.detach().clone().to(device)
        dist.all_reduce(total)
        return total.item() / world

    rows = slice(dp_rank, None, dp)
    sides = [_Side("oslo", model, optimizer, rows, mean_over_dp)]
    for peer in spec["peers"]:  # the transformers side, and in the test a perturbed copy of it (negative control)
        theirs, their_optimizer, their_dp = _build_theirs(peer["path"], tp, dp, device, dtype, spec["liger"])
        sides.append(_Side(peer["name"], theirs, their_optimizer, slice(their_dp, None, dp), mean_over_dp))
    steps, rounds, warmup = spec["steps"], spec["rounds"], spec["warmup"]
    total = warmup + steps * rounds + 1
    data = {seed: torch.randint(0, spec["vocab"], (total, batch, seq), generator=torch.Generator().manual_seed(seed))
            for seed in {1, *(peer.get("data_seed", 1) for peer in spec["peers"])}}
    data_of = [1] + [peer.get("data_seed", 1) for peer in spec["peers"]]
    for index, side in enumerate(sides):
        for i in range(warmup):
            side.step(data[data_of[index]][i].to(device))
    for r in range(rounds):
        for index, side in enumerate(sides):  # A, B, A, B, ...
            dist.barrier()
            if device == "cuda":
                torch.cuda.synchronize()
            start, cpu = time.perf_counter(), time.process_time()
            for i in range(warmup + r * steps, warmup + (r + 1) * steps):
                side.step(data[data_of[index]][i].to(device))
            if device == "cuda":
                torch.cuda.synchronize()
            side.windows.append((time.perf_counter() - start, time.process_time() - cpu))
    if spec.get("profile"):  # every rank steps once more (the collectives meet); rank 0 records it
        if dist.get_rank() == 0:
            _profile(sides, data, data_of, total - 1, device, spec)
        else:
            for number, side in enumerate(sides):
                side.step(data[data_of[number]][total - 1].to(device))
    memory = [_measure_memory(side, data[data_of[index]][total - 1].to(device), device)
              for index, side in enumerate(sides)]
    mine = {"windows": [side.windows for side in sides], "memory": memory}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        result = {"sides": []}
        for index, side in enumerate(sides):
            walls = [max(rank["windows"][index][r][0] for rank in gathered) for r in range(rounds)]
            cpus = [sum(rank["windows"][index][r][1] for rank in gathered) for r in range(rounds)]
            result["sides"].append({
                "name": side.name, "losses": side.losses, "window_seconds": walls, "window_cpu_seconds": cpus,
                "state_bytes": max(rank["memory"][index]["state_bytes"] for rank in gathered),
                "activation_bytes": max(rank["memory"][index]["activation_bytes"] for rank in gathered),
                "peak_memory_bytes": max(rank["memory"][index].get("peak_memory_bytes", 0) for rank in gathered)})
        if device == "cuda":
            result["device_name"] = torch.cuda.get_device_name()
        with open(out_path, "w") as handle:
            json.dump(result, handle)


# ------------------------------------------------------------------------------------------------ the driver


def pair_spec(model: str, size: str, layout: str, *, root: str, steps: int, rounds: int, warmup: int,
              device: str = "cpu", liger: bool = False, extra_peers: tuple = ()) -> dict:
    """What one pair runs (ours against ``transformers``, plus ``extra_peers``: ``transformers`` sides made unfair
    on purpose, the test's negative control); saves the checkpoints under ``root`` on first use."""
    path = os.path.join(root, f"{model}-{size}")
    if not os.path.exists(path):
        save_checkpoint(model, size, path)
    _, batch, seq = SIZES[(model, size)]
    missing = peer_missing(model, layout)
    peers = [] if missing else [{"name": "transformers", "path": path}]
    for peer in extra_peers:  # {"name": ..., "seed": s}: weights from another seed; {"data_seed": s}: other batches
        peer = {"path": path, **peer}
        if "seed" in peer:
            peer["path"] = os.path.join(root, f"{model}-{size}-seed{peer['seed']}")
            if not os.path.exists(peer["path"]):
                save_checkpoint(model, size, peer["path"], seed=peer["seed"])
        peers.append(peer)
    return dict(model=model, size=size, path=path, layout=layout, device=device, batch=batch, seq=seq, steps=steps,
                rounds=rounds, warmup=warmup, vocab=make_config(model, size).vocab_size, peers=peers, liger=liger,
                peer_missing=missing, out=os.path.join(root, f"{model}-{size}-{layout}.json"))


def run_pairs(specs: list[dict], timeout: float = 3600.0) -> list[dict]:
    """Spawn one process group per world size, run its pairs there, return one summary row per (pair, peer)."""
    from tests.helpers.dist import run_distributed

    worlds: dict[int, list[dict]] = {}
    for spec in specs:
        tp, dp = LAYOUTS[spec["layout"]]
        worlds.setdefault(tp * dp, []).append(spec)
    for world, group in sorted(worlds.items()):
        begun = time.perf_counter()
        run_distributed(_worker, world, group, timeout=timeout)
        print(f"[world {world}: {len(group)} pairs, {time.perf_counter() - begun:.0f}s]", file=sys.stderr, flush=True)
    return [row for spec in specs for row in summarize(spec)]


def summarize(spec: dict) -> list[dict]:
    with open(spec["out"]) as handle:
        raw = json.load(handle)
    model, size, layout = spec["model"], spec["size"], spec["layout"]
    tp, dp = LAYOUTS[layout]
    batch, seq, steps = spec["batch"], spec["seq"], spec["steps"]
    config = make_config(model, size)
    tokens = steps * batch * seq
    flops = _flops_per_token(config, seq) if spec["device"] == "cuda" else None
    sides = {side["name"]: _summarize(side, tokens, flops, raw.get("device_name"), spec) for side in raw["sides"]}
    base = dict(model=model, size=size, layout=layout, tp=tp, dp=dp, world=tp * dp, batch=batch, seq=seq,
                steps=steps, rounds=spec["rounds"], warmup=spec["warmup"],
                device=raw.get("device_name", spec["device"]), params=_parameters(config), liger=spec["liger"])
    ours = sides.pop("oslo")
    if not sides:
        return [dict(base, peer=None, peer_missing=spec["peer_missing"], ours=ours)]
    rows = []
    for name, theirs in sides.items():
        diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
        rows.append(dict(base, peer=name, ours=ours, theirs=theirs, max_loss_diff=diff,
                         losses_agree=diff <= LOSS_ATOL,
                         ratio_tokens_per_s=ours["tokens_per_s"] / theirs["tokens_per_s"],
                         ratio_tokens_per_cpu_s=ours["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"]))
    return rows


def _flops_per_token(config, seq: int) -> float:
    """``6 N + 6 L s h``: N the matmul parameters (all but the embedding tables, plus the LM head)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    matmul = sum(p.numel() for p in model.parameters()) - embedding + config.vocab_size * config.hidden_size
    return 6 * matmul + 6 * config.num_hidden_layers * seq * config.hidden_size


def _parameters(config) -> int:
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _summarize(side: dict, tokens: int, flops: float | None, device_name: str | None, spec: dict) -> dict:
    wall = statistics.median(side["window_seconds"])
    cpu = statistics.median(side["window_cpu_seconds"])
    out = {"tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu, "best_tokens_per_s":
            tokens / min(side["window_seconds"]), "final_loss": side["losses"][-1], "losses": side["losses"],
            "state_bytes": side["state_bytes"], "activation_bytes": side["activation_bytes"],
            "peak_memory_bytes": side["peak_memory_bytes"], "window_seconds": side["window_seconds"]}
    peak = spec.get("peak_tflops") or next((v for k, v in BF16_PEAK_TFLOPS.items() if k in (device_name or "")), None)
    if flops and peak:  # CUDA only: model FLOPs over the bf16 dense peak of all the ranks' GPUs
        tp, dp = LAYOUTS[spec["layout"]]
        out["mfu"] = tokens / wall * flops / (peak * 1e12 * tp * dp)
    return out


def _mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


def table(rows: list[dict]) -> str:
    head = ("| model | params | layout (tp x dp) | ours tok/s | peer tok/s | ratio | ours tok/CPU-s | peer tok/CPU-s "
            "| ratio | ours state / act MiB per rank | peer state / act MiB per rank | final loss ours / peer "
            "| max abs dloss |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    def rate(side):
        mfu = f" (MFU {100 * side['mfu']:.1f}%)" if "mfu" in side else ""
        return f"{side['tokens_per_s']:.0f}{mfu}"

    for row in rows:
        ours = row["ours"]
        name = f"{row['model']}-{row['size']} | {row['params'] / 1e6:.1f}M | {row['layout']} ({row['tp']}x{row['dp']})"
        ours_mem = f"{_mib(ours['state_bytes'])} / {_mib(ours['activation_bytes'])}"
        if row["peer"] is None:
            lines.append(f"| {name} | {rate(ours)} | - | - | {ours['tokens_per_cpu_s']:.0f} | - | - "
                         f"| {ours_mem} | - | {ours['final_loss']:.5f} / - | {row['peer_missing']} |")
            continue
        theirs = row["theirs"]
        flag = "" if row["losses_agree"] else " MISMATCH"
        lines.append(
            f"| {name} | {rate(ours)} | {rate(theirs)} | {row['ratio_tokens_per_s']:.2f} "
            f"| {ours['tokens_per_cpu_s']:.0f} | {theirs['tokens_per_cpu_s']:.0f} "
            f"| {row['ratio_tokens_per_cpu_s']:.2f} | {ours_mem} "
            f"| {_mib(theirs['state_bytes'])} / {_mib(theirs['activation_bytes'])} "
            f"| {ours['final_loss']:.5f} / {theirs['final_loss']:.5f} | {row['max_loss_diff']:.1e}{flag} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2"], choices=["llama", "gpt2"])
    parser.add_argument("--sizes", nargs="+", default=None, help="default: tiny small (--quick: tiny)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=None, help="steps per timed window (default 2, --quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="timed windows per side (default 5, --quick 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny models, short windows (under 2 minutes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-liger", action="store_true", help="CUDA: leave Liger-Kernel off the transformers side")
    parser.add_argument("--peak-tflops", type=float, default=None, help="CUDA: bf16 dense peak per GPU, for MFU")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="one more step per side under torch.profiler on rank 0; top ops to DIR/<pair>-<side>.txt")
    parser.add_argument("--no-sp", action="store_true", help="tensor parallelism here without sequence parallelism")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = args.sizes or (["tiny"] if args.quick else ["tiny", "small"])
    steps = args.steps or (1 if args.quick else 2)
    rounds = args.rounds or (2 if args.quick else 5)
    liger = False
    if args.device == "cuda" and not args.no_liger:
        import importlib.util

        liger = importlib.util.find_spec("liger_kernel") is not None
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="oslo_peers_") as root:
        specs = [pair_spec(model, size, layout, root=root, steps=steps, rounds=rounds, warmup=args.warmup,
                           device=args.device, liger=liger)
                 for model in args.models for size in sizes for layout in args.layouts]
        for spec in specs:
            spec["peak_tflops"], spec["profile"] = args.peak_tflops, args.profile
            spec["sequence_parallel"] = not args.no_sp
        rows = run_pairs(specs)
    print(table(rows))
    mismatched = [f"{r['model']}-{r['size']} {r['layout']}" for r in rows if r.get("losses_agree") is False]
    print(f"\nlosses agree within {LOSS_ATOL:g} on every pair" if not mismatched else
          f"\nLOSSES DISAGREE on {mismatched}")
    print(f"total {time.perf_counter() - start:.0f}s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                       "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
                       "device": args.device, "liger": liger, "torch": torch.__version__,
                       "transformers": __import__("transformers").__version__, "loss_atol": LOSS_ATOL,
                       "command": " ".join(["python", "benchmarks/peers.py", *(argv or sys.argv[1:])])},
                      handle, indent=1)
        print(f"wrote {args.json}")
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
