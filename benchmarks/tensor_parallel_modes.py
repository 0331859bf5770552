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

Every message is classified as *weight* traffic (its per-rank piece has the shape of one of the measured module's
parameters: SUMMA's weight-block broadcasts and weight-gradient reduces, 3D's weight all-gathers and gradient
reduce-scatters, the depth all-reduce of 2.5D, bias and norm-scale gradients) or *activation* traffic (everything
else: activation blocks, their gradients, norm statistics), and both are reported.

Two measurements:

- ``linear``: one square linear ``Y = X A`` (``[T, h] x [h, h]``, no bias) per mode, fwd + bwd: the setting of the
  papers' cost table (Colossal-AI's docs: ``2(P-1)/P`` for 1D, ``6(q-1)/q`` for 2D, ``3(q-1)(d+1)/(dq)`` for 2.5D,
  ``6(q-1)/q**3`` for 3D). Activation traffic is printed in units of ``X`` (``T*h*4`` bytes), weight traffic in
  units of ``A`` (``h*h*4``), next to the exact count the algorithms imply (``expected_split``) and to the table.
  The table assumes ``X`` and ``A`` of one size, so it is compared with the sum of the two (see BENCHMARKS.md).
- ``block``: one GPT-2-medium block (``transformer.h.0``), activation traffic in units of the layer's activation
  ``b*s*h*4``, weight traffic in units of the block's weights ``12*h*h*4``.

    python benchmarks/tensor_parallel_modes.py --json benchmarks/tensor_parallel_modes.json
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


def expected_split(mode: str, tp: int, depth: int) -> tuple[float, float]:
    """Per-rank (activation in units of X, weight in units of A) of one square linear, fwd + bwd, as the algorithms
    run here (ring all-reduce ``2(P-1)/P``, the other collectives ``(P-1)/P`` of the full message):

    - 1D: one all-reduce of X per linear (the row-parallel forward or the column-parallel backward);
    - 2D / 2.5D (SUMMA, three products of q steps): X blocks move three times (forward broadcast, the reduce of
      dX, the broadcast for dW), ``(q-1)/(d q**2)`` each; A blocks three times ``(q-1)/q**2`` (two broadcasts, the
      reduce of dW), plus the depth all-reduce of dW ``2(d-1)/(d q**2)``;
    - 3D: X moves four times ``(q-1)/q**3`` (gather, reduce-scatter, and their backward mirrors), A twice (the
      all-gather over z and the reduce-scatter of its gradient).
    """
    if mode == "1d":
        return 2 * (tp - 1) / tp, 0.0
    if mode == "3d":
        q = round(tp ** (1 / 3))
        return 4 * (q - 1) / q ** 3, 2 * (q - 1) / q ** 3
    q = round((tp // depth) ** 0.5)
    return 3 * (q - 1) / (depth * q * q), 3 * (q - 1) / (q * q) + 2 * (depth - 1) / (depth * q * q)


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


def _first_tensor(value):
    if torch.is_tensor(value):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class CommCounter:
    """Counts per-rank bytes sent by the collectives that run inside it (see module docstring), split into weight
    traffic (the per-rank piece has the shape of one of ``weight_shapes``) and activation traffic."""

    def __init__(self, weight_shapes=()):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.bytes, self.weight_bytes, self.calls = 0.0, 0.0, {}
        self.weight_shapes = {tuple(shape) for shape in weight_shapes}

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
        # the per-rank piece: an all-gather's input, a reduce-scatter's output, the tensor of the others
        piece = _first_tensor(args[1] if op.startswith("allgather") else args[0])
        if piece is not None and tuple(piece.shape) in self.weight_shapes:
            self.weight_bytes += sent
        self.bytes += sent
        self.calls[op] = self.calls.get(op, 0) + 1

    @property
    def activation_bytes(self) -> float:
        return self.bytes - self.weight_bytes

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _square_linear(ctx, h: int) -> torch.nn.Module:
    """One ``h x h`` linear (no bias, GPT-2's Conv1D layout) at ``ctx``'s mode; 1D: a column + row pair (two)."""
    from torch import nn

    from oslo_models.parallel_layers.summa import Grid
    from oslo_models.parallel_layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from oslo_models.parallel_layers.tensor_parallel_2d import Linear2D
    from oslo_models.parallel_layers.tensor_parallel_3d import Linear3D

    options = dict(bias=False, layout="conv1d")
    mode = ctx.tensor_parallel_mode
    if mode == "1d":
        module = nn.Sequential(ColumnParallelLinear(h, h, group=ctx.tp_group, **options),
                               RowParallelLinear(h, h, group=ctx.tp_group, **options))
    elif mode == "3d":
        module = Linear3D(h, h, cube=Grid.from_context(ctx), column=True, **options)
    else:
        module = Linear2D(h, h, grid=Grid.from_context(ctx), **options)
    for param in module.parameters():
        nn.init.normal_(param, std=0.02)
    return module


def _layer_worker(tp: int, mode: str, depth: int, shape: dict, target: str, out_file: str) -> None:
    import torch.distributed as dist
    import transformers

    import oslo_models as om
    from oslo_models.distributed.context import ParallelContext
    from oslo_models.parallel_layers.summa import Grid

    cfg = om.ParallelConfig(tensor_parallel_size=tp, tensor_parallel_mode=mode, tensor_parallel_depth=depth)
    torch.manual_seed(0)
    b, s, h = shape["batch"], shape["seq"], shape["hidden"]
    if target == "linear":
        ctx = ParallelContext.from_config(cfg)
        block = _square_linear(ctx, h)
        run = lambda x: block(x)  # noqa: E731
    else:
        config = transformers.GPT2Config(n_embd=h, n_head=shape["heads"], n_layer=1, vocab_size=128,
                                         n_positions=s, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = om.GPT2Model.from_config(config, parallel=cfg).train()
        ctx, block = model.parallel_context, model.h[0]
        run = lambda x: block(x, None, None)[0]  # noqa: E731
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

    weight_dims = {dim for p in block.parameters() for dim in p.shape}
    tokens = local.reshape(-1, local.shape[-1]).shape[0]
    if tokens in weight_dims:  # an activation block would look like a weight block to the CommCounter
        raise ValueError(f"{tokens} tokens per rank equals a weight dimension; choose another --batch/--seq")
    run(local).sum().backward()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    weight_shapes = [p.shape for p in block.parameters()] + [p.t().shape for p in block.parameters() if p.ndim == 2]
    with CommCounter(weight_shapes) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(local).sum().backward()
    elapsed = time.perf_counter() - start
    result = dict(rank=ctx.rank, bytes_sent=counter.bytes, weight_bytes=counter.weight_bytes,
                  activation_bytes_sent=counter.activation_bytes, calls=counter.calls, seconds=elapsed,
                  param_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
                  activation_bytes=saved[0])
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, result)
    if ctx.rank == 0:
        Path(out_file).write_text(json.dumps(gathered))


def run(shape: dict, layouts, target: str = "block") -> list[dict]:
    from tests.helpers.dist import run_distributed

    rows = []
    h = shape["hidden"]
    activation = shape["batch"] * shape["seq"] * h * 4
    weights = (12 if target == "block" else 1) * h * h * 4
    for name, tp, mode, depth in layouts:
        with tempfile.NamedTemporaryFile(suffix=".json") as handle:
            run_distributed(_layer_worker, tp, tp, mode, depth, shape, target, handle.name, timeout=1200)
            ranks = json.loads(Path(handle.name).read_text())
        mean = lambda key: sum(r[key] for r in ranks) / len(ranks)  # noqa: E731
        linears = 2 if target == "linear" and mode == "1d" else 1  # 1D measures a column + row pair
        expected_act, expected_weight = expected_split(mode, tp, depth)
        rows.append(dict(layout=name, target=target, ranks=tp, mode=mode, depth=depth,
                         bytes_sent_per_rank=mean("bytes_sent"),
                         volume_in_activations=mean("bytes_sent") / activation,
                         activation_traffic=mean("activation_bytes_sent") / activation / linears,
                         weight_traffic=mean("weight_bytes") / weights / linears,
                         expected_activation=expected_act, expected_weight=expected_weight,
                         paper_cost=paper_cost(mode, tp, depth),
                         param_mib_per_rank=mean("param_bytes") / 2 ** 20,
                         activation_mib_per_rank=mean("activation_bytes") / 2 ** 20,
                         seconds=max(r["seconds"] for r in ranks), collectives=ranks[0]["calls"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=320)  # 2560 tokens: no token block has a weight's shape
    parser.add_argument("--json", default=None)
    parser.add_argument("--layouts", default=",".join(name for name, *_ in LAYOUTS))
    parser.add_argument("--targets", default="linear,block")
    args = parser.parse_args()
    shape = dict(batch=args.batch, seq=args.seq, hidden=1024, heads=16)
    chosen = [layout for layout in LAYOUTS if layout[0] in args.layouts.split(",")]
    rows = []
    for target in args.targets.split(","):
        found = run(shape, chosen, target)
        rows += found
        unit = "per linear: activation in X, weight in A" if target == "linear" else \
            "per block: activation in b*s*h, weight in 12*h*h"
        print(f"\n{target}: [b={shape['batch']}, s={shape['seq']}, h=1024] fp32, CPU gloo ({unit})")
        print(f"{'layout':8} {'sent/rank MiB':>13} {'act':>7} {'(exp.)':>7} {'weight':>7} {'(exp.)':>7} "
              f"{'act+wt':>7} {'paper':>7} {'params MiB':>10} {'saved act MiB':>13} {'fwd+bwd s':>9}")
        for row in found:
            print(f"{row['layout']:8} {row['bytes_sent_per_rank'] / 2 ** 20:13.2f} {row['activation_traffic']:7.3f} "
                  f"{row['expected_activation']:7.3f} {row['weight_traffic']:7.3f} {row['expected_weight']:7.3f} "
                  f"{row['activation_traffic'] + row['weight_traffic']:7.3f} {row['paper_cost']:7.3f} "
                  f"{row['param_mib_per_rank']:10.2f} {row['activation_mib_per_rank']:13.2f} {row['seconds']:9.2f}")
    if args.json:
        meta = dict(shape=shape, machine=platform.platform(), cpu_count=__import__("os").cpu_count(),
                    torch=torch.__version__, date=datetime.date.today().isoformat(), device="cpu (gloo)")
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))


if __name__ == "__main__":
    main()
