"""Apply a per-block plan (``ParallelConfig.block_plan``, ``oslo_models/block_plan.py``) with FSDP2.

Each block (the model protocol's ``fsdp_units``: the model's ``_no_split_modules`` blocks, in module order) becomes
its own ``fully_shard`` unit:

- ``shard=True``: over the dp mesh (its parameters ``[rows/dp, ...]`` per rank at rest; all-gather before forward,
  and again before backward when ``reshard_after_forward``; reduce-scatter of its gradient in backward);
- ``shard=False``: over a ``(dp_replicate=dp, dp_shard=1)`` mesh: whole parameters on every rank, nothing gathered,
  its gradient all-reduced (averaged) over dp in backward - ZeRO-0 for that block, its AdamW state whole too.

The root unit (embeddings, final norm, head) is sharded over dp and kept gathered through the step (ZeRO-2/3's
root). Checkpoint flags are applied when the model is built (``common/stack/checkpointing.apply_block_checkpointing``).
Collectives: building the replicate mesh (``init_device_mesh``, every rank); per step as above.
"""
from __future__ import annotations

from torch import nn


def check_block_plan(model: nn.Module, plan) -> list[nn.Module]:
    """The model's blocks, one per plan entry; ``ValueError`` (before any collective) when the counts differ."""
    from ..utils.model_protocol import protocol_of

    units = protocol_of(model).fsdp_units(model)
    if len(units) != len(plan):
        raise ValueError(f"ParallelConfig.block_plan has {len(plan)} entries but {type(model).__name__} has "
                         f"{len(units)} blocks (FSDP units: {sorted({type(u).__name__ for u in units})}); give one "
                         f"entry per block")
    return units


def replicate_mesh(context):
    """A 2D ``(dp_replicate, dp_shard)`` mesh with ``dp_shard`` of size 1: FSDP2 on it replicates (collective:
    every rank builds the whole ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = (context.pp_size, context.dp_size, 1, context.cp_size, context.tp_size)
    mesh = init_device_mesh(context.device.type, sizes, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    return mesh["dp_replicate", "dp_shard"]


def fully_shard_blocks(model: nn.Module, mesh, context, plan) -> None:
    """``fully_shard`` every block as ``plan`` says (sharded over ``mesh`` or replicated), then the root."""
    from torch.distributed.fsdp import fully_shard

    units = check_block_plan(model, plan)
    replicated = replicate_mesh(context) if any(not choice.shard for choice in plan) else None
    for module, choice in zip(units, plan):
        if choice.shard:
            fully_shard(module, mesh=mesh, reshard_after_forward=choice.reshard_after_forward)
        else:
            fully_shard(module, mesh=replicated, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
