"""Divisibility rules carried by the components, so a family's ``validate_parallel_config`` is derived, not written.

Each component class (an attention, an MLP, a norm) declares ``parallel_rules(config) -> list[Rule]``: which of
the config's sizes its plan splits, and how. ``check_rules`` turns them into the ``ValueError`` a user must get
before any process group exists:

- ``Heads``: attention heads split over the ranks (1D: ``tp`` must divide them; 2D/2.5D/3D: the grid's ``q``);
- ``KeyValueHeads``: grouped-query key/value heads, split when ``tp <= n_kv`` (``tp`` must divide them) and
  replicated when ``tp > n_kv`` (then ``n_kv`` must divide ``tp``); on the grid as ``Heads``;
- ``Features``: a hidden or feed-forward size split as columns/rows (``tp``; on the grid ``q``);
- ``RefusedAxis``: a feature of this config the component cannot run under a parallel axis (ALiBi biases or logit
  soft-capping under context parallelism): ``NotImplementedError`` with the reason when that axis is on.

A family's ``StackSpec`` lists its components, so its rules are the union of theirs (``spec_rules``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ....config import ParallelConfig
from ....parallel_layers.kv_heads import check_grid_heads


@dataclass(frozen=True)
class Rule:
    """A size the plan splits over the tensor-parallel ranks: 1D: ``check_tp`` (``tp`` must divide it); 2D/2.5D/3D:
    ``check_grid`` (heads over the grid's ``q``). A rule overrides what differs."""

    name: str  # the config attribute, as the user knows it (``num_attention_heads``, ``n_inner``)
    value: int

    def check(self, parallel: ParallelConfig, model_type: str) -> None:
        if parallel.tensor_parallel_mode != "1d":
            self.check_grid(parallel, model_type)
        else:
            self.check_tp(parallel.tensor_parallel_size, model_type)

    def check_grid(self, parallel: ParallelConfig, model_type: str) -> None:
        check_grid_heads(self.value, parallel, f"{model_type}: {self.name}")

    def check_tp(self, tp: int, model_type: str) -> None:
        if self.value % tp:
            raise ValueError(f"{model_type}: {self.name}={self.value} is not divisible by tensor_parallel_size={tp}")


@dataclass(frozen=True)
class Heads(Rule):
    """Attention heads split over the ranks (the defaults)."""


@dataclass(frozen=True)
class KeyValueHeads(Rule):
    query_heads: int = 0

    def check(self, parallel, model_type):
        if self.query_heads % self.value:
            raise ValueError(f"{model_type}: num_attention_heads={self.query_heads} is not a multiple of "
                             f"{self.name}={self.value}")
        super().check(parallel, model_type)

    def check_tp(self, tp, model_type):
        if tp <= self.value:
            super().check_tp(tp, model_type)
        elif tp % self.value:
            raise ValueError(f"{model_type}: tensor_parallel_size={tp} exceeds {self.name}={self.value} but is not "
                             f"a multiple of it, so the key/value heads cannot be replicated evenly")


@dataclass(frozen=True)
class Features(Rule):
    def check_grid(self, parallel, model_type):
        q = parallel.grid_shape[-1]
        if self.value % q:
            raise ValueError(f"{model_type}: {self.name}={self.value} is not divisible by the grid's q={q}")


@dataclass(frozen=True)
class RefusedAxis(Rule):
    """``name``: the ``ParallelConfig`` field of the axis (``context_parallel_size``); ``value``: unused (0);
    ``reason``: why the feature cannot run under it (shown to the user and in the composition table)."""

    reason: str = ""

    def check(self, parallel, model_type):
        size = getattr(parallel, self.name)
        if size > 1:
            raise NotImplementedError(f"{model_type}: {self.name}={size} is refused: {self.reason}")


def component_classes(spec) -> list[type]:
    classes = []
    for entry in spec.components.values():
        classes.extend(entry if isinstance(entry, tuple) else (entry,))
    return classes


def spec_rules(spec, config) -> list[Rule]:
    """Every component's rules for ``config`` (duplicates removed, in order)."""
    rules = []
    for component in component_classes(spec):
        for rule in getattr(component, "parallel_rules", lambda config: [])(config):
            if rule not in rules:
                rules.append(rule)
    return rules


def check_rules(rules, config, parallel: ParallelConfig) -> None:
    for rule in rules:
        rule.check(parallel, config.model_type)


def check_head_size(config, model: str, hidden: str = "hidden_size", heads: str = "num_attention_heads") -> None:
    """``ValueError`` unless the attention heads divide the hidden size; ``model``, ``hidden`` and ``heads``: how the
    message names the model and the two sizes (GPT-2: ``n_embd``, ``n_head``)."""
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"{model} {hidden}={config.hidden_size} is not divisible by {heads}="
                         f"{config.num_attention_heads}")
