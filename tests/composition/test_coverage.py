"""Every composing cell of the composition table is mapped to the CI test that trains it (``coverage.py``), and the
cells no CI test trains yet are pinned: a new composing cell must come with a test, or be added here on purpose."""
from __future__ import annotations

from pathlib import Path

from oslo_models.composition.table import pairs
from tests.composition.coverage import covering_tests, declared, residual_cells

ROOT = Path(__file__).resolve().parents[2]

# Composing cells that only the opt-in matrix (OSLO_COMPOSITION_MATRIX=1 tests/composition/test_matrix.py) trains:
# mixed precision, compile, activation checkpointing and offload with the parallel axes, and the grid with ZeRO.
NOT_YET_IN_CI = {
    "ac x bf16", "ac x compile", "ac x fp16", "bf16 x compile", "bf16 x moe", "compile x moe", "cp x ac", "cp x bf16",
    "cp x compile", "cp x fp16", "cp x moe", "dp x ac", "dp x bf16", "dp x compile", "dp x fp16", "ep x ac",
    "ep x bf16", "ep x compile", "ep x fp16", "fp16 x compile", "fp16 x moe", "grid x ac", "grid x bf16",
    "grid x compile", "grid x dp", "grid x fp16", "grid x off", "grid x z1", "grid x z2", "grid x z3", "off x ac",
    "off x bf16", "off x compile", "off x cp", "off x ep", "off x fp16", "off x moe", "pp x compile", "sp x bf16",
    "sp x compile", "sp x fp16", "sp x off", "sp x z1", "sp x z2", "tp x bf16", "tp x fp16", "tp x off", "tp x z2",
    "z1 x ac", "z1 x bf16", "z1 x compile", "z1 x fp16", "z2 x ac", "z2 x bf16", "z2 x compile", "z2 x cp",
    "z2 x ep", "z2 x fp16", "z2 x moe", "z3 x ac", "z3 x bf16", "z3 x compile", "z3 x fp16",
    # the disk tier (issue 36): trained in CI at tp x dp and ep x dp x ZeRO-3 (tests/training/test_nvme_offload.py)
    "grid x nvme", "nvme x ac", "nvme x bf16", "nvme x compile", "nvme x cp", "nvme x fp16",
    "pp x nvme", "sp x nvme", "z2 x nvme",
}


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
    print(f"cells: {tested} tested in CI, {refused} refused, {len(residual)} only in the opt-in matrix")
