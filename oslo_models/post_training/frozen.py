"""A frozen model (a DPO / GRPO reference, a distillation teacher) at its own layout, fed the trained model's batches.

The trained model and the frozen one live in the same world with different ``ParallelContext`` s: a policy at tp 2
x dp 2 with a reference at tp 4 (or tp 1 x dp 4, or the policy's own layout). The ranks of the frozen model's
tensor-parallel group must run its forward on the same tokens, but they may hold different batches (they belong to
different data-parallel replicas of the policy). :func:`run_frozen` therefore:

1. all-gathers the batch shapes over the frozen model's tp group (one all-gather of ``[keys, 2]`` ints), pads every
   rank's batch to the most rows and each key to its largest width (ids and masks with 0, on the right; a rollout's
   prompt and completion keys each to their own), all-gathers the padded batches (one all-gather per key);
2. runs ``fn(model, batch)`` once: on this rank's own batch when every rank of the group holds the same one (the
   frozen model shares the policy's tensor-parallel groups, or runs at tp 1), otherwise on the concatenation of the
   group's batches (``[tp * rows, seq]``);
3. returns this rank's rows of what ``fn`` returned (per-row tensors ``[rows, seq', ...]``, cut back to this rank's
   width of the first key in sorted order: ``seq' - (seq_max - seq)``).

Right padding leaves every real position's logits unchanged in a causal LM. Collectives: the all-gathers above over
the frozen model's tp group, then its own forward's. Under ``torch.no_grad``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .log_probs import base_model_of


def _tp_group(model):
    context = getattr(base_model_of(model), "parallel_context", None)
    if context is None or context.tp_size == 1:
        return None
    return context.tp_group


@torch.no_grad()
def run_frozen(model, batch: dict, fn) -> dict:
    """``fn(model, batch) -> {name: [rows, seq', ...]}`` run at ``model``'s own layout on this rank's ``batch``
    (``{name: [rows, seq]}`` integer tensors: ids and masks), every rank of ``model``'s tensor-parallel group taking
    part (see the module docstring). Returns this rank's rows."""
    group = _tp_group(model)
    if group is None:
        return fn(model, batch)
    names = sorted(batch)
    shapes = torch.tensor([list(batch[name].shape[:2]) for name in names], dtype=torch.long)
    size = dist.get_world_size(group)
    device = batch[names[0]].device
    all_shapes = [torch.empty_like(shapes) for _ in range(size)]
    dist.all_gather(all_shapes, shapes.to(device) if device.type != "cpu" else shapes, group=group)
    all_shapes = torch.stack([s.cpu() for s in all_shapes])  # [tp, keys, 2]
    rows = int(all_shapes[..., 0].max())
    widths = all_shapes[..., 1].max(0).values  # per key: a rollout's prompt and completion keep their own widths
    gathered = {}
    for index, name in enumerate(names):
        x = batch[name]
        padded = torch.nn.functional.pad(x, (0, int(widths[index]) - x.shape[1], 0, rows - x.shape[0]), value=0)
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        gathered[name] = parts
    same = bool((all_shapes == all_shapes[0]).all()) and all(
        torch.equal(parts[0], part) for parts in gathered.values() for part in parts[1:])
    if same:
        return fn(model, batch)
    out = fn(model, {name: torch.cat(parts) for name, parts in gathered.items()})
    rank = dist.get_rank(group)
    own_rows, own_seq = batch[names[0]].shape[:2]
    trim = int(widths[0]) - own_seq
    result = {}
    for key, value in out.items():
        mine = value[rank * rows:rank * rows + own_rows]
        result[key] = mine[:, :mine.shape[1] - trim] if value.dim() > 1 and trim else mine
    return result
