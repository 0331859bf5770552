"""Communication and memory of one GPT-2-medium-shaped transformer layer under each tensor-parallel mode.

For every layout (1D at 4 and 8 ranks, 2D at 4, 2.5D at 8 with depth 2, 3D at 8) this spawns gloo processes on CPU,
builds a one-layer GPT-2 (``n_embd=1024``, 16 heads, FFN 4096) through the library at that layout, and runs one
forward + backward of the block (``transformer.h.0``) on this rank's piece of a ``[b, s, h]`` activation. It
measures, per rank:

- bytes sent at the collectives, counted where they run (a ``TorchDispatchMode`` sees every ``c10d`` op: its kind,
  tensor size and group size) with the standard algorithms' per-rank traffic: ring all-reduce ``2(P-1)/P n``,
  all-gather / reduce-scatter / broadcast / reduce ``(P-1)/P n`` (``n`` the full message, ``P`` the group);
- parameter bytes of the block on the rank, and activation bytes saved for backward (``saved_tensors_hooks``,
  unique storages);
- wall time of the forward + backward (CPU, shared box: indicative only).

Volumes are printed in units of the layer's full activation ``b*s*h*4`` bytes next to the papers' per-layer
costs (Colossal-AI's table: ``2(P-1)/P`` for 1D, ``6(q-1)/q`` for 2D, ``3(q-1)(d+1)/(dq)`` for 2.5D,
``6(q-1)/q**3`` for 3D), which count
a different unit per mode (see BENCHMARKS.md), so the ratio column is informative, not a pass/fail.

    python benchmarks/tensor_parallel_modes.py --json tensor_parallel_modes.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

LAYOUTS = [  # (name, tensor_parallel_size, mode, depth)
    ("1d-4", 4, "1d", 1), ("1d-8", 8, "1d", 1), ("2d-4", 4, "2d", 1), ("2.5d-8", 8, "2.5d", 2), ("3d-8", 8, "3d", 1),
]


def paper_cost(mode: str, tp: int, depth: int) -> float:
    if mode == "1d":
        return 2 * (tp - 1) / tp
    if mode == "3d":
        q = round(tp ** (1 / 3))
        return 6 * (q - 1) / q ** 3
    q = round((tp // depth) ** 0.5)
    return 6 * (q - 1) / q if mode == "2d" else 3 * (q - 1) * (depth + 1) / (depth * q)


def _group_size(args, kwargs) -> int:
    import torch.distributed as dist

    for value in list(args) + list(kwargs.values()):
        if isinstance(value, dist.ProcessGroup):
            return value.size()
        if isinstance(value, torch.ScriptObject):  # the c10d ops take the group as a boxed ScriptObject
            try:
                return dist.ProcessGroup.unbox(value).size()
            except RuntimeError:  # another boxed argument (the ReduceOp)
                continue
    raise RuntimeError("no process group among the op's arguments")


def _numel(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


class CommCounter:
    """Counts per-rank bytes sent by the collectives that run inside it (see module docstring)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.bytes, self.calls = 0.0, {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if str(func).startswith("c10d."):
                    counter.record(str(func).split(".")[1], args, kwargs)
                return func(*args, **kwargs)

        self.mode = _Mode()

    def record(self, op: str, args, kwargs) -> None:
        size = _group_size(args, kwargs)
        if size == 1:
            return
        share = (size - 1) / size
        if op.startswith("allreduce"):
            sent = 2 * share * _numel(args[0])
        elif op.startswith("allgather"):
            sent = share * _numel(args[0])  # output list: the full gathered message
        elif op.startswith("reduce_scatter"):
            sent = share * _numel(args[1])  # input list: the full message
        elif op.startswith(("broadcast", "reduce")):
            sent = share * _numel(args[0])
        else:
            return
        self.bytes += sent
        self.calls[op] = self.calls.get(op, 0) + 1

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _layer_worker(tp: int, mode: str, depth: int, shape: dict, out_file: str) -> None:
    import torch.distributed as dist
    import transformers

    import oslo_models as om
    from oslo_models.parallel_layers.summa import Grid

    cfg = om.ParallelConfig(tensor_parallel_size=tp, tensor_parallel_mode=mode, tensor_parallel_depth=depth)
    config = transformers.GPT2Config(n_embd=shape["hidden"], n_head=shape["heads"], n_layer=1, vocab_size=128,
                                     n_positions=shape["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = om.GPT2Model.from_config(config, parallel=cfg).train()
    ctx = model.parallel_context
    block = model.h[0]
    b, s, h = shape["batch"], shape["seq"], shape["hidden"]
    full = torch.randn(b, s, h, generator=torch.Generator().manual_seed(1))
    if mode == "1d":
        local = full
    else:
        grid = Grid.from_context(ctx)
        local = grid.local_rows(full).chunk(grid.q, dim=-1)[grid.row.rank]
    local = local.clone().requires_grad_(True)

    saved, seen = [0], set()

    def pack(tensor):
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            saved[0] += key[1]
        return tensor

    block(local, None, None)[0].sum().backward()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    with CommCounter() as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(local, None, None)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
    elapsed = time.perf_counter() - start
    result = dict(rank=ctx.rank, bytes_sent=counter.bytes, calls=counter.calls, seconds=elapsed,
                  param_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
                  activation_bytes=saved[0])
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, result)
    if ctx.rank == 0:
        Path(out_file).write_text(json.dumps(gathered))


def run(shape: dict, layouts) -> list[dict]:
    from tests.helpers.dist import run_distributed

    rows = []
    activation = shape["batch"] * shape["seq"] * shape["hidden"] * 4
    for name, tp, mode, depth in layouts:
        with tempfile.NamedTemporaryFile(suffix=".json") as handle:
            run_distributed(_layer_worker, tp, tp, mode, depth, shape, handle.name, timeout=1200)
            ranks = json.loads(Path(handle.name).read_text())
        mean = lambda key: sum(r[key] for r in ranks) / len(ranks)  # noqa: E731
        rows.append(dict(layout=name, ranks=tp, mode=mode, depth=depth,
                         bytes_sent_per_rank=mean("bytes_sent"),
                         volume_in_activations=mean("bytes_sent") / activation,
                         paper_cost=paper_cost(mode, tp, depth),
                         param_mib_per_rank=mean("param_bytes") / 2 ** 20,
                         activation_mib_per_rank=mean("activation_bytes") / 2 ** 20,
                         seconds=max(r["seconds"] for r in ranks), collectives=ranks[0]["calls"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--layouts", default=",".join(name for name, *_ in LAYOUTS))
    args = parser.parse_args()
    shape = dict(batch=args.batch, seq=args.seq, hidden=1024, heads=16)
    chosen = [layout for layout in LAYOUTS if layout[0] in args.layouts.split(",")]
    rows = run(shape, chosen)
    header = f"{'layout':8} {'sent/rank MiB':>13} {'x activation':>12} {'paper':>7} {'params MiB':>10} " \
             f"{'saved act MiB':>13} {'fwd+bwd s':>9}"
    print(f"one GPT-2-medium layer, activation [b={shape['batch']}, s={shape['seq']}, h=1024] fp32, CPU gloo")
    print(header)
    for row in rows:
        print(f"{row['layout']:8} {row['bytes_sent_per_rank'] / 2 ** 20:13.2f} {row['volume_in_activations']:12.3f} "
              f"{row['paper_cost']:7.3f} {row['param_mib_per_rank']:10.2f} {row['activation_mib_per_rank']:13.2f} "
              f"{row['seconds']:9.2f}")
    if args.json:
        meta = dict(shape=shape, machine=platform.platform(), cpu_count=__import__("os").cpu_count(),
                    torch=torch.__version__, date=datetime.date.today().isoformat(), device="cpu (gloo)")
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))


if __name__ == "__main__":
    main()
