"""Composition: the parallel axes, the one order they are applied in, one check of a whole layout, and the table of
what composes (generated from that check). See ``axes.py``, ``check.py`` and ``table.py``."""
from .axes import APPLY_ORDER, AXES, AXIS, Axis, Layout, combine, exclusive
from .check import check_layout, check_model_layout, refusal

__all__ = ["APPLY_ORDER", "AXES", "AXIS", "Axis", "Layout", "check_layout", "check_model_layout", "combine", "exclusive", "refusal"]
