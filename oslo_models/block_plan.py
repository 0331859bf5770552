"""Per-block data-parallel plans (OSDP / Galvatron): ``ParallelConfig.block_plan``, pure data (no torch here).

A block plan has one entry per transformer block (the model's ``_no_split_modules`` blocks, in module order; the
decoder layers of a causal LM), each a ``BlockChoice``:

- ``shard``: the block's parameters, gradients and AdamW state are sharded over dp (the block is its own FSDP2
  ``fully_shard`` unit, ZeRO-3 style) or, ``False``, replicated on every dp rank (an FSDP2 unit on a
  ``(dp, 1)`` replicate x shard mesh: nothing gathered, its gradients all-reduced over dp, ZeRO-0 style);
- ``reshard_after_forward``: a sharded block frees its gathered parameters after forward and gathers them again
  for backward (ZeRO-3), or keeps them gathered until its backward (ZeRO-2: one all-gather fewer, the block's
  full parameters held from its forward to its backward). Meaningless (``False``) for a replicated block;
- ``checkpoint``: the block keeps only its input in forward and recomputes its activations in backward
  (``activation_checkpointing="full"`` for that block alone).

Everything outside the blocks (embeddings, final norm, head) is the root unit: sharded, kept gathered through
the step (as at ZeRO-2/3). ``om.training.prepare`` / ``shard_data_parallel`` apply the plan (``training/zero.py``);
the model applies the checkpoint flags when it is built. The planner chooses plans (``planner/blocks.py``).

In JSON (``ParallelConfig.to_json`` / ``from_json``) a plan is a list of objects with those three keys; missing
keys take the defaults ``shard=True``, ``reshard_after_forward=shard``, ``checkpoint=False``.
"""
from __future__ import annotations

from dataclasses import dataclass

BLOCK_KEYS = ("shard", "reshard_after_forward", "checkpoint")


@dataclass(frozen=True)
class BlockChoice:
    shard: bool = True
    reshard_after_forward: bool = True
    checkpoint: bool = False


def describe_plan(plan) -> str:
    """One code per block, runs compressed (``S*3 Rc*1``): ``S`` sharded and resharded after forward (ZeRO-3),
    ``s`` sharded and kept gathered until backward (ZeRO-2), ``R`` replicated (ZeRO-0); ``c``: checkpointed."""
    codes = [("S" if c.reshard_after_forward else "s") if c.shard else "R" for c in plan]
    codes = [code + ("c" if c.checkpoint else "") for code, c in zip(codes, plan)]
    runs: list[list] = []
    for code in codes:
        if runs and runs[-1][0] == code:
            runs[-1][1] += 1
        else:
            runs.append([code, 1])
    return " ".join(f"{code}*{n}" for code, n in runs)


def normalize_block_plan(plan) -> tuple[BlockChoice, ...] | None:
    """``None`` or a sequence of ``BlockChoice`` / mappings -> a tuple of ``BlockChoice``; ``ValueError`` naming the
    block and the key for anything else (unknown keys, non-bool values, a replicated block resharded)."""
    if plan is None:
        return None
    if isinstance(plan, (str, bytes, dict)) or not hasattr(plan, "__iter__"):
        raise ValueError(f"ParallelConfig.block_plan must be a list with one entry per transformer block "
                         f"(objects with keys {BLOCK_KEYS}), got {type(plan).__name__}")
    out = []
    for index, entry in enumerate(plan):
        if isinstance(entry, BlockChoice):
            values = {key: getattr(entry, key) for key in BLOCK_KEYS}
        elif isinstance(entry, dict):
            unknown = sorted(set(entry) - set(BLOCK_KEYS))
            if unknown:
                raise ValueError(f"ParallelConfig.block_plan[{index}] has unknown key(s) {unknown}; "
                                 f"known: {list(BLOCK_KEYS)}")
            values = dict(entry)
        else:
            raise ValueError(f"ParallelConfig.block_plan[{index}] must be an object with keys {BLOCK_KEYS}, "
                             f"got {entry!r}")
        values.setdefault("shard", True)
        values.setdefault("reshard_after_forward", values["shard"])
        values.setdefault("checkpoint", False)
        for key in BLOCK_KEYS:
            if not isinstance(values[key], bool):
                raise ValueError(f"ParallelConfig.block_plan[{index}].{key} must be a bool, got {values[key]!r}")
        if values["reshard_after_forward"] and not values["shard"]:
            raise ValueError(f"ParallelConfig.block_plan[{index}]: reshard_after_forward=True needs shard=True "
                             f"(a replicated block has nothing to gather again)")
        out.append(BlockChoice(**values))
    if not out:
        raise ValueError("ParallelConfig.block_plan is empty; use None for no per-block plan")
    return tuple(out)


def check_block_plan_layout(config) -> None:
    """What a block plan composes with (``ValueError`` / ``NotImplementedError`` naming the reason): zero_stage 3
    (the FSDP2 engine; the plan overrides it per block) without pipeline, context or expert parallelism, HSDP,
    offload or a model-wide activation checkpointing mode."""
    if config.block_plan is None:
        return
    if config.zero_stage != 3:
        raise ValueError(f"ParallelConfig.block_plan is applied by the FSDP2 engine: it needs zero_stage=3 (the "
                         f"plan then decides per block), got zero_stage={config.zero_stage}")
    if config.activation_checkpointing is not None:
        raise ValueError(f"ParallelConfig.block_plan decides checkpointing per block (its 'checkpoint' keys); "
                         f"leave activation_checkpointing=None, got {config.activation_checkpointing!r}")
    for name, trivial, why in (
            ("pipeline_parallel_size", 1, "pipeline stages are FSDP2 roots of their own (training/zero.py)"),
            ("context_parallel_size", 1, "the replicate/shard meshes would have to span dp x cp"),
            ("expert_parallel_size", 1, "experts are sharded over their own expert-data-parallel group"),
            ("data_parallel_shard_size", None, "HSDP already fixes a (replicate, shard) mesh for every unit"),
            ("offload", None, "offload policies are per engine, not per block")):
        if getattr(config, name) != trivial:
            raise NotImplementedError(f"ParallelConfig.block_plan with {name}={getattr(config, name)!r} is not "
                                      f"implemented: {why}")
