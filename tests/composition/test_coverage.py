"""Every composing cell of the composition table is mapped to the CI test that trains it (``coverage.py``): none is
left untested (``NOT_YET_IN_CI`` stays empty), so every cell is tested in CI or refused."""
from __future__ import annotations

from itertools import combinations
from pathlib import Path

from oslo_models.composition.table import multi_axis, pairs
from tests.composition.combined import combined_cells
from tests.composition.coverage import COMBINED, EIGHT_RANKS, axes_of, covering_tests, declared, residual_cells

ROOT = Path(__file__).resolve().parents[2]

# Composing cells that no CI test trains (only the opt-in matrix, OSLO_COMPOSITION_MATRIX=1 tests/composition/
# test_matrix.py). The combined layouts (combined.py) train the rest; a new composing cell must come with a test.
# (The last three, the Mixtral's experts under bf16/fp16, train since their comparison forces the reference's
# routing decisions: tests/helpers/forced_routing.py.)
NOT_YET_IN_CI: set[str] = set()


def test_declared_tests_exist():
    for test in declared():
        path, _, function = test.partition("::")
        assert f"def {function}(" in (ROOT / path).read_text(encoding="utf-8"), test


def test_every_composing_cell_is_tested_or_pinned():
    covered = covering_tests()
    composing = [c for c in pairs() if c.status == "composes"]
    residual = {c.name for c in residual_cells()}
    assert residual == NOT_YET_IN_CI, "update coverage.py (the test that trains it) or NOT_YET_IN_CI"
    for c in composing:
        assert frozenset(c.axes) in covered or c.name in residual, c.name
    tested = len(composing) - len(residual)
    refused = sum(c.status == "refused" for c in pairs())
    print(f"cells: {tested} tested in CI, {refused} refused, {len(residual)} pinned as open (neither)")


def test_combined_layouts_compose_and_each_is_needed():
    """Every combined layout is accepted, and each trains at least one cell no other declared test trains (a layout
    that stops being needed is dropped, not kept as CI time)."""
    cells = combined_cells()
    assert all(c.status == "composes" for c in cells), [(c.name, c.reason) for c in cells if c.status != "composes"]
    others = {test: layouts for test, layouts in declared().items() if test not in (COMBINED, EIGHT_RANKS)}
    others[EIGHT_RANKS] = [axes_of(c.layout) for c in multi_axis() if c.status == "composes"]
    elsewhere = {frozenset(p) for layouts in others.values() for axes in layouts for size in (1, 2)
                 for p in combinations(sorted(axes), size)}
    for c in cells:
        axes = sorted(axes_of(c.layout))
        assert {frozenset(p) for p in combinations(axes, 2)} - elsewhere, c.name
