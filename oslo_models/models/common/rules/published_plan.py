"""``base_model_tp_plan`` of a config class, published from the family's ``StackSpec`` on first read.

A config class cannot import its family's model code at class creation (the model code imports the config), so the
plan is a descriptor that imports ``module`` and reads ``spec`` the first time it is asked for, then keeps the
strings. It is a class attribute only: ``transformers`` never writes it into ``config.json``."""
from __future__ import annotations

import importlib


class PublishedTPPlan:
    """``transformers``' vocabulary (``"colwise"``, ``"rowwise"``, ...) of ``module.spec``'s plan; ``drop``: module
    patterns (relative to the base model) to leave out (Llama has no q/k norms, Qwen3 has them)."""

    def __init__(self, module: str, spec: str, *, drop: tuple[str, ...] = ()):
        self.module, self.spec, self.drop = module, spec, drop
        self._plan = None

    def __get__(self, obj, cls=None) -> dict[str, str]:
        if self._plan is None:
            spec = getattr(importlib.import_module(self.module), self.spec)
            plan = spec.plan().hf_tp_plan()
            self._plan = {pattern: style for pattern, style in plan.items() if pattern not in self.drop}
        return dict(self._plan)
