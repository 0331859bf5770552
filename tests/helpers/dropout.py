"""Observe the dropout masks a model draws, without touching the library, and check the tensor-parallel RNG rules.

``DropoutMasks(model)`` is a ``TorchDispatchMode``: inside ``with DropoutMasks(model) as rec:`` every random draw a
dropout makes (``aten.bernoulli_`` on CPU, ``aten.native_dropout`` on CUDA, also inside SDPA's attention-dropout)
is recorded as a boolean keep-mask together with the name of the innermost module running at that moment (forward
hooks keep a stack of module names). Attention-probability dropout happens inside the attention module's call to
SDPA, so it is labelled with the attention module; residual dropouts with their ``Dropout`` module.

``check_tp_rules(masks, rules, group)`` compares the masks of every tensor-parallel rank, draw by draw: a draw whose
label matches a ``"split"`` rule must differ across ranks (activations that differ per rank need a stream per rank),
one matching a ``"replicated"`` rule must be equal on every rank (replicated activations must drop the same
elements everywhere, or the replicas drift apart). Every draw must match exactly one rule and every rule must match
some draw, so a new dropout site, or one that stopped drawing, fails the test instead of going unchecked.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_BERNOULLI = {_aten.bernoulli_.float, _aten.bernoulli_.Tensor, _aten.bernoulli.p, _aten.bernoulli.default}


class DropoutMasks(TorchDispatchMode):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.masks: list[tuple[str, torch.Tensor]] = []
        self._stack: list[str] = []
        self._handles = []

    def __enter__(self):
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._push(n)))
            self._handles.append(module.register_forward_hook(lambda m, a, o: self._pop()))
        return super().__enter__()

    def _push(self, name: str) -> None:  # hooks must return None, or they would replace inputs/outputs
        self._stack.append(name)

    def _pop(self) -> None:
        self._stack.pop()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        label = self._stack[-1] if self._stack else "<outside the model>"
        if func in _BERNOULLI:
            self.masks.append((label, out != 0))
        elif func is _aten.native_dropout.default:
            self.masks.append((label, out[1].bool()))
        return out


def _rule_of(label: str, rules: dict[str, str]) -> str:
    hits = [pattern for pattern in rules if re.fullmatch(pattern, label)]
    assert len(hits) == 1, f"dropout draw in {label!r} matches {len(hits)} rules of {sorted(rules)}"
    return hits[0]


def check_tp_rules(masks: list[tuple[str, torch.Tensor]], rules: dict[str, str], group=None,
                   what: str = "") -> dict[str, int]:
    """Assert the rules (see module docstring) over ``group``'s ranks; return how many draws each rule checked.

    ``rules``: regular expression over the module label (full match) -> ``"split"`` or ``"replicated"``."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, [(label, mask.cpu()) for label, mask in masks], group=group)
    labels = [[label for label, _ in rank_masks] for rank_masks in gathered]
    assert all(other == labels[0] for other in labels), f"{what}: ranks drew dropout in different places"
    checked = dict.fromkeys(rules, 0)
    for index, label in enumerate(labels[0]):
        pattern = _rule_of(label, rules)
        kind = rules[pattern]
        per_rank = [rank_masks[index][1] for rank_masks in gathered]
        assert 0 < per_rank[0].float().mean() < 1, f"{what}: {label}: the mask keeps all or nothing"
        same = all(mask.shape == per_rank[0].shape and torch.equal(mask, per_rank[0]) for mask in per_rank)
        if kind == "replicated":
            assert same, f"{what}: {label} drops replicated activations but the tp ranks drew different masks"
        else:
            assert kind == "split", kind
            distinct = len({tuple(mask.flatten().tolist()) for mask in per_rank})
            assert distinct == len(per_rank), (f"{what}: {label} drops activations that differ per tp rank but "
                                               f"ranks drew the same mask (one stream shared by the tp ranks)")
        checked[pattern] += 1
    unused = [pattern for pattern in rules if not checked[pattern]]
    assert not unused, f"{what}: no dropout drawn where the rules expect some: {unused}"
    return checked
