"""The generic path's rows of the composition table (``oslo_models/composition/generic_rows.py``, printed in
``docs/composition.md``; ``tests/composition/test_table.py`` keeps the page equal to the generated text).

No process: each row names a test that exists, in a file that trains (or refuses) that model type; the rows cover every
axis the generic path has; exactly the rows listed below are refused, before any process group, each with its reason
(the validation decides, not the row). Negative controls: a row naming a missing test function, or a type its test
file never builds, is reported; a refused layout among the composing rows is decided as refused.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch.distributed as dist

from oslo_models.composition.generic_rows import ROWS, decide

ROOT = Path(__file__).resolve().parents[2]
REFUSED = {"grid", "ac (selective)", "pp x cp x ac (offload)", "pp x ep x dp x ac (partitioned)",
           "ep (no expert plan)", "tp (no plan)", "cp (no attention heads)", "tp x dp x lora (fresh adapter)",
           "pp x ep x dp x lora (experts)", "pp x cp x compile (whole model)"}
AXES = {"tp", "sp", "pp", "dp", "z1", "z2", "z3", "off", "nvme", "cp", "ep", "ac", "compile", "lora", "moe"}


def unbacked(rows) -> list[str]:
    """The rows whose test is missing, or whose test file never names the row's model type."""
    found = []
    for row in rows:
        path, _, function = row.test.partition("::")
        file = ROOT / path
        text = file.read_text(encoding="utf-8") if file.is_file() else ""
        if not re.search(rf"^def {re.escape(function)}\(", text, re.M):
            found.append(f"{row.axes}: no {row.test}")
        elif f'"{row.model_type}"' not in text:
            found.append(f"{row.axes}: {path} does not build {row.model_type!r}")
    return found


def test_every_row_names_a_test_that_builds_its_type():
    assert unbacked(ROWS) == []
    wrong = dataclasses.replace(ROWS[0], test=ROWS[0].test + "_missing")
    other_type = dataclasses.replace(ROWS[0], model_type="mamba2")
    assert len(unbacked([wrong, other_type])) == 2


def test_rows_cover_every_generic_axis():
    named = {axis for row in ROWS for axis in re.findall(r"[a-z0-9]+", row.axes)}
    assert AXES <= named, AXES - named


def test_the_validation_decides_which_rows_are_refused():
    assert not dist.is_initialized()
    decided = {row.axes: decide(row) for row in ROWS}
    assert not dist.is_initialized()  # every decision came from configs alone
    assert {axes for axes, reason in decided.items() if reason} == REFUSED
    for axes in REFUSED:
        assert len(decided[axes]) > 60, (axes, decided[axes])  # a reason, not a bare flag
    composing = next(row for row in ROWS if row.axes == "pp x cp")
    broken = dataclasses.replace(composing, layout=dataclasses.replace(
        composing.layout, parallel={**composing.layout.parallel, "activation_checkpointing": "selective"}))
    assert "activation_checkpointing='selective'" in decide(broken)
