"""The parallel axes a layout combines, in the one order the project applies them.

An ``Axis`` is the smallest layout that turns one feature on (``tp``: ``tensor_parallel_size=2``; ``z3``: two
data-parallel ranks under ZeRO-3; ``bf16``: Accelerate's bf16 autocast). ``combine(*axes)`` merges axes into one
``Layout``: sizes take the larger value, so ``sp`` (tp 2 with sequence parallelism) with ``tp`` is tp 2 with
sequence parallelism, and ``z1`` with ``dp`` is two data-parallel ranks under ZeRO-1. Two axes that choose
different values of one option (``tp`` and ``grid``: the tensor-parallel mode; ``z1`` and ``z2``; ``fp16`` and
``bf16``) are *exclusive*: one option, not a composition.

The order of application (``APPLY_ORDER``) is fixed, whatever the layout, and each pipeline stage goes through it
the same way:

1. ``pp`` cuts the model into stages (``pipeline/stage.py``) before anything is allocated;
2. tensor and sequence parallelism (the plan's styles, 1D or the 2D/2.5D/3D grid) split each stage's weights;
3. context parallelism splits the sequence (the stack's attention hooks);
4. expert parallelism places each rank's experts (carved out of the data-parallel ranks);
5. activation checkpointing wraps the blocks;
6. ``torch.compile`` compiles the result (Accelerate's ``dynamo_backend`` or the caller);
7. data parallelism and ZeRO 1-3 (``training.prepare``) wrap it over the data-parallel (x context) group, and mixed
   precision (Accelerate's autocast, loss scaling) goes around the step.

Steps 1-5 happen in ``from_pretrained(..., parallel=ParallelConfig(...))``; 6-7 in ``training.prepare``. The world
is one ``DeviceMesh`` (``distributed/context.py``: ``("pp", "dp", "cp", "tp")``, tensor-parallel ranks innermost,
experts carved out of ``dp``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

NVME_SCRATCH = "/tmp/oslo_nvme_offload"  # the nvme axis's offload_path (each rank writes rank<N>/ in it)
APPLY_ORDER = ("pp", "tp/sp/grid", "cp", "ep", "activation_checkpointing", "compile", "dp/zero", "mixed_precision")


@dataclass(frozen=True)
class Layout:
    """One layout: the ``ParallelConfig`` options (``parallel``) and the training options ``training.prepare`` and
    the ``Accelerator`` take (``zero_stage``, ``cpu_offload``, ``mixed_precision``, ``compile``)."""

    parallel: dict = field(default_factory=dict)
    zero_stage: int = 0
    cpu_offload: bool = False
    mixed_precision: str = "no"
    compile: bool = False
    moe: bool = False  # the layout needs a mixture-of-experts model (expert parallelism)

    def key(self) -> tuple:
        """A hashable identity (two cells with the same key train the same layout)."""
        return (tuple(sorted(self.parallel.items())), self.zero_stage, self.cpu_offload, self.mixed_precision,
                self.compile, self.moe)

    @property
    def world_size(self) -> int:
        p = self.parallel
        return (p.get("tensor_parallel_size", 1) * p.get("pipeline_parallel_size", 1)
                * p.get("context_parallel_size", 1) * p.get("data_parallel_size", 1))

    def parallel_config(self):
        from ..config import ParallelConfig

        return ParallelConfig(**{**self.parallel, "zero_stage": self.zero_stage})

    def describe(self) -> str:
        p, parts = self.parallel, []
        mode = p.get("tensor_parallel_mode", "1d")
        if p.get("tensor_parallel_size", 1) > 1:
            parts.append(f"tp{p['tensor_parallel_size']}" + ("" if mode == "1d" else f"({mode})")
                         + ("+sp" if p.get("sequence_parallel") else ""))
        for key, short in (("pipeline_parallel_size", "pp"), ("context_parallel_size", "cp"),
                           ("expert_parallel_size", "ep"), ("data_parallel_size", "dp")):
            if p.get(key, 1) > 1:
                parts.append(f"{short}{p[key]}")
        if p.get("data_parallel_shard_size"):
            parts.append(f"hsdp{p['data_parallel_shard_size']}")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}" + ("+offload" if self.cpu_offload else "")
                         + ("+nvme" if p.get("offload") == "nvme" else ""))
        if p.get("activation_checkpointing"):
            parts.append(f"ac:{p['activation_checkpointing']}")
        if self.mixed_precision != "no":
            parts.append(self.mixed_precision)
        if self.compile:
            parts.append("compile")
        return " x ".join(parts) or "single process"


@dataclass(frozen=True)
class Axis:
    name: str
    description: str
    layout: Layout


def _layout(moe: bool = False, **options) -> Layout:
    training = {key: options.pop(key) for key in ("zero_stage", "cpu_offload", "mixed_precision", "compile")
                if key in options}
    return Layout(parallel=options, moe=moe, **training)


AXES = (
    Axis("tp", "1D tensor parallelism (Megatron column/row)", _layout(tensor_parallel_size=2)),
    Axis("sp", "sequence parallelism (with 1D tp)", _layout(tensor_parallel_size=2, sequence_parallel=True)),
    Axis("grid", "2D tensor parallelism (Optimus, q x q grid)",
         _layout(tensor_parallel_size=4, tensor_parallel_mode="2d")),
    Axis("pp", "pipeline parallelism (1F1B)", _layout(pipeline_parallel_size=2, num_microbatches=2)),
    Axis("dp", "data parallelism (DDP)", _layout(data_parallel_size=2)),
    Axis("z1", "ZeRO-1 (optimizer state sharded)", _layout(data_parallel_size=2, zero_stage=1)),
    Axis("z2", "ZeRO-2 (FSDP2, gradients sharded)", _layout(data_parallel_size=2, zero_stage=2)),
    Axis("z3", "ZeRO-3 (FSDP2, parameters sharded)", _layout(data_parallel_size=2, zero_stage=3)),
    Axis("off", "CPU offload (FSDP2, with ZeRO-3 unless paired)",
         _layout(data_parallel_size=2, zero_stage=3, cpu_offload=True)),
    # offload_path is a placeholder: tests/helpers/composition.py trains each run in a fresh scratch folder
    Axis("nvme", "optimizer state on local disk (ZeRO-Infinity's NVMe tier, with ZeRO-3 unless paired)",
         _layout(data_parallel_size=2, zero_stage=3, offload="nvme", offload_path=NVME_SCRATCH)),
    Axis("cp", "context parallelism (ring)", _layout(context_parallel_size=2)),
    Axis("ep", "expert parallelism (mixture of experts)",
         _layout(moe=True, expert_parallel_size=2, data_parallel_size=2)),
    Axis("ac", "activation checkpointing (full)", _layout(activation_checkpointing="full")),
    Axis("fp16", "fp16 autocast with loss scaling", _layout(mixed_precision="fp16")),
    Axis("bf16", "bf16 autocast", _layout(mixed_precision="bf16")),
    Axis("compile", "torch.compile", _layout(compile=True)),
)
AXIS = {axis.name: axis for axis in AXES}


# Pairs that are one option with two values, not two features: nothing to compose.
EXCLUSIVE = {
    frozenset(("tp", "grid")): "tensor_parallel_mode chooses 1D or a grid",
    frozenset(("z1", "z2")): "zero_stage chooses one stage",
    frozenset(("z1", "z3")): "zero_stage chooses one stage",
    frozenset(("z2", "z3")): "zero_stage chooses one stage",
    frozenset(("fp16", "bf16")): "mixed_precision chooses one dtype",
}


def exclusive(*names: str) -> str | None:
    """Why the axes ``names`` cannot be one layout (they choose different values of one option), else ``None``."""
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if (why := EXCLUSIVE.get(frozenset((a, b)))) is not None:
                return f"{a} x {b}: {why}"
    return None


def _pairs_with_zero(layout: Layout) -> bool:
    """Whether ``layout`` is an offload axis (``off``, ``nvme``): ZeRO-3 unless paired with a ZeRO axis."""
    return layout.cpu_offload or layout.parallel.get("offload") is not None


def combine(*names: str) -> Layout:
    """One layout with every axis in ``names`` on (``ValueError`` for exclusive axes). Sizes take the larger value;
    a ZeRO axis sets the stage (``off`` or ``nvme`` alone means ZeRO-3 with offload, with ``z1``/``z2`` it keeps their
    stage, in either order: ``combine(a, b) == combine(b, a)``)."""
    if (why := exclusive(*names)) is not None:
        raise ValueError(why)
    layouts = [AXIS[name].layout for name in names]
    parallel: dict = {}
    for layout in layouts:
        for key, value in layout.parallel.items():
            old = parallel.get(key, value)
            parallel[key] = max(old, value) if isinstance(value, int) and not isinstance(value, bool) else value
    # ``off`` and ``nvme`` carry ZeRO-3 only as their default: a plain ZeRO axis (z1/z2/z3, exclusive among
    # themselves, so at most one stage) wins whatever the order of ``names``
    stages = {layout.zero_stage for layout in layouts if layout.zero_stage and not _pairs_with_zero(layout)}
    defaults = {layout.zero_stage for layout in layouts if layout.zero_stage and _pairs_with_zero(layout)}
    offload = any(layout.cpu_offload for layout in layouts)
    zero = max(stages) if stages else max(defaults, default=0)
    precision = next((layout.mixed_precision for layout in layouts if layout.mixed_precision != "no"), "no")
    if parallel.get("expert_parallel_size", 1) > 1:  # experts are carved out of dp: dp must hold them
        parallel["data_parallel_size"] = max(parallel.get("data_parallel_size", 1), parallel["expert_parallel_size"])
    return Layout(parallel=parallel, zero_stage=zero, cpu_offload=offload, mixed_precision=precision,
                  compile=any(layout.compile for layout in layouts), moe=any(layout.moe for layout in layouts))
