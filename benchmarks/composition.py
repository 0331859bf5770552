"""Tokens/s, per-rank memory and communication bytes per step, by axis, of every composing 8-process layout.

The layouts are the four- and five-axis ones of ``oslo_models/composition/table.py`` (``multi_axis()``) that
compose, the ones ``tests/composition/test_eight_ranks.py`` trains against ``transformers``: a small Llama (and a
small Mixtral for the expert-parallel layout), built from one saved checkpoint at the layout, wrapped by
``om.training.prepare`` at the layout's ZeRO stage, trained a few AdamW steps on a global batch of ``--batch`` rows
of ``--seq`` tokens (each replica its rows, cp ranks their chunks; pipelines through ``model.train_step``).

Measured per rank:

- ``tokens/s``: global tokens of the timed steps / the slowest rank's wall time (CPU gloo on a shared box:
  indicative, for comparing layouts of one run only);
- memory: ``state MiB``, the bytes of this rank's parameters, gradients and optimizer state (local shards of
  DTensors; counted from the tensors, exact), and ``peak RSS MiB`` (``getrusage`` max resident set: includes the
  interpreter and libraries, ~300 MiB of it, and every transient buffer);
- communication: every ``c10d`` op that runs during the timed steps is seen by a ``TorchDispatchMode`` (DDP's
  reducer, FSDP2, the pipeline's point-to-point sends and our layers' collectives all dispatch through the ``c10d``
  ops; counted where they run, not derived from the plan), its bytes turned into per-rank traffic with the
  standard algorithms (ring all-reduce ``2(P-1)/P n``, all-gather / reduce-scatter / broadcast ``(P-1)/P n``,
  all-to-all ``(P-1)/P n``, a send ``n``) and attributed to the axis whose group has the op's ranks (``tp``,
  ``tp_*`` grid sub-axes, ``cp``, ``dp``, ``dp_cp``, ``pp``, ``ep``, ``edp``, ``world``; ``other`` for groups the
  wrappers build over the same ranks under another name, e.g. FSDP2's HSDP sub-meshes, named by their size).

    python benchmarks/composition.py --json benchmarks/composition.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

AXIS_ORDER = ("tp", "tp_row", "tp_col", "tp_dep", "cp", "dp", "dp_cp", "ep", "edp", "etp", "pp")


def _group_ranks(args, kwargs) -> tuple[int, ...] | None:
    import torch.distributed as dist

    for value in list(args) + list(kwargs.values()):
        group = value if isinstance(value, dist.ProcessGroup) else None
        if isinstance(value, torch.ScriptObject):  # the c10d ops take the group as a boxed ScriptObject
            try:
                group = dist.ProcessGroup.unbox(value)
            except RuntimeError:  # another boxed argument (the ReduceOp)
                continue
        if group is not None:
            return tuple(dist.get_process_group_ranks(group))
    return None


def _bytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


class AxisCommCounter:
    """Per-rank bytes sent by the ``c10d`` ops run inside it, by the axis of their group (module docstring)."""

    def __init__(self, context):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.by_ranks: dict[tuple, str] = {}
        for name in reversed(AXIS_ORDER):  # the first name in AXIS_ORDER wins for groups of the same ranks
            try:
                axis = context.axis(name)
            except ValueError:  # an axis this layout does not have (the grid sub-axes at 1D)
                continue
            if axis.size > 1:
                self.by_ranks[tuple(sorted(axis.ranks))] = name
        self.by_ranks[tuple(range(context.world_size))] = "world"
        self.bytes: dict[str, float] = {}
        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if str(func).startswith("c10d."):
                    counter.record(str(func).split(".")[1], args, kwargs)
                return func(*args, **kwargs)

        self.mode = _Mode()

    def record(self, op: str, args, kwargs) -> None:
        ranks = _group_ranks(args, kwargs)
        if ranks is None or len(ranks) == 1:
            return
        size, share = len(ranks), (len(ranks) - 1) / len(ranks)
        if op.startswith("allreduce"):
            sent = 2 * share * _bytes(args[0])
        elif op.startswith(("allgather", "_allgather_base")):
            sent = share * _bytes(args[0])  # the output: the full gathered message
        elif op.startswith(("reduce_scatter", "_reduce_scatter_base")):
            sent = share * _bytes(args[1])  # the input: the full message
        elif op.startswith(("broadcast", "reduce", "alltoall")):
            sent = share * _bytes(args[0])
        elif op.startswith("send"):
            sent = _bytes(args[0])
        else:  # recv (counted at its send), barrier, monitored waits
            return
        axis = self.by_ranks.get(tuple(sorted(ranks)), f"other({size})")
        self.bytes[axis] = self.bytes.get(axis, 0.0) + sent

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _state_bytes(model, optimizer) -> int:
    def local(t):
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    from oslo_models.training import unwrap_optimizer

    total = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in model.parameters())
    inner = unwrap_optimizer(optimizer)
    optimizers = [o for o, _ in getattr(inner, "inner", [])] or [inner]
    for opt in optimizers:
        opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local optimizer as .optim
        for state in opt.state.values():
            total += sum(local(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def _worker(name: str, layout, model_type: str, path: str, shape: dict, steps: int, out_file: str) -> None:
    import torch.distributed as dist

    import oslo_models as om
    from accelerate import Accelerator
    from oslo_models import training
    from tests.helpers.layouts import local_batch

    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=layout.parallel_config(), progress=False).train()
    context = model.parallel_context
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=layout.zero_stage,
                                        cpu_offload=layout.cpu_offload)
    ids = torch.randint(1, 100, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
    replica = {k: v.chunk(context.dp_size)[context.dp_rank] for k, v in batch.items()}
    local = local_batch(context, replica, shift_labels=True)
    pipelined = context.pp_size > 1

    def step():
        if pipelined:
            model.train_step(local)
        else:
            model(**local).loss.backward()
        optimizer.step()

    step()  # warm-up: schedules, FSDP2 lazy init, optimizer state
    optimizer.zero_grad()
    counter = AxisCommCounter(context)
    dist.barrier()
    start = time.perf_counter()
    with counter:
        for _ in range(steps):
            step()
            if _ < steps - 1:
                optimizer.zero_grad()
    elapsed = time.perf_counter() - start
    state = _state_bytes(training.unwrap_model(model), optimizer)  # gradients still held: the step's peak state
    optimizer.zero_grad()
    result = dict(rank=context.rank, seconds=elapsed, state_bytes=state,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  comm={axis: sent / steps for axis, sent in counter.bytes.items()})
    gathered = [None] * context.world_size
    dist.all_gather_object(gathered, result)
    if context.rank == 0:
        Path(out_file).write_text(json.dumps(gathered))


def _checkpoint(model_type: str, folder: str, hidden: int) -> str:
    import transformers

    from oslo_models.models.registry import family_record

    record = family_record(model_type)
    options = dict(record.tiny_config)
    options.update(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=hidden // 8, vocab_size=128, max_position_embeddings=512)
    config = transformers.AutoConfig.for_model(model_type, **options)
    torch.manual_seed(0)
    record.model_class("causal_lm").hf_twin(config).save_pretrained(folder)
    return folder


def run(shape: dict, steps: int, names: list[str] | None = None) -> list[dict]:
    from oslo_models.composition.table import multi_axis
    from tests.helpers.dist import run_distributed

    cells = [c for c in multi_axis() if c.status == "composes" and (not names or c.name in names)]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        paths = {t: _checkpoint(t, f"{root}/{t}", shape["hidden"]) for t in {c.model_type for c in cells}}
        for c in cells:
            out = f"{root}/{len(rows)}.json"
            run_distributed(_worker, c.layout.world_size, c.name, c.layout, c.model_type, paths[c.model_type],
                            shape, steps, out, timeout=1800)
            ranks = json.loads(Path(out).read_text())
            seconds = max(r["seconds"] for r in ranks)
            axes = sorted({axis for r in ranks for axis in r["comm"]})
            comm = {axis: sum(r["comm"].get(axis, 0.0) for r in ranks) / len(ranks) for axis in axes}
            rows.append(dict(axes=c.name, layout=c.layout.describe(), family=c.model_type, ranks=len(ranks),
                             tokens_per_s=shape["batch"] * shape["seq"] * steps / seconds,
                             state_mib_max=max(r["state_bytes"] for r in ranks) / 2 ** 20,
                             state_mib_min=min(r["state_bytes"] for r in ranks) / 2 ** 20,
                             peak_rss_mib_max=max(r["peak_rss_bytes"] for r in ranks) / 2 ** 20,
                             comm_mib_per_rank_step=comm and {a: v / 2 ** 20 for a, v in comm.items()},
                             comm_mib_per_rank_step_total=sum(comm.values()) / 2 ** 20))
            print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    comm = ", ".join(f"{a} {v:.2f}" for a, v in row["comm_mib_per_rank_step"].items())
    return (f"{row['axes']:22} {row['layout']:38} {row['tokens_per_s']:9.1f} {row['state_mib_min']:6.2f}-"
            f"{row['state_mib_max']:<6.2f} {row['peak_rss_mib_max']:8.0f}  {row['comm_mib_per_rank_step_total']:7.2f} "
            f"({comm})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layouts", default=None, help="comma-separated axes names of multi_axis() (default: all)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shape = dict(batch=args.batch, seq=args.seq, hidden=args.hidden)
    print(f"Llama/Mixtral h={args.hidden}, 4 layers, batch {args.batch} x {args.seq} tokens, fp32, CPU gloo, "
          f"{args.steps} timed steps")
    print(f"{'axes':22} {'layout':38} {'tokens/s':>9} {'state MiB/rank':>13} {'RSS MiB':>8}  comm MiB/rank/step "
          f"(by axis)")
    rows = run(shape, args.steps, args.layouts.split(",") if args.layouts else None)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            shape=shape, steps=args.steps, rows=rows, torch=torch.__version__, machine=platform.machine(),
            processor=platform.processor(), date=datetime.date.today().isoformat()), indent=1))


if __name__ == "__main__":
    main()
