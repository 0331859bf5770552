"""Which CI test trains which composition of axes: the map from the table's composing cells to the tests that run them.

A cell (an axis alone or a pair, ``oslo_models.composition.table.pairs``) is *tested in CI* when some test of the
default suite trains a layout with every axis of the cell turned on against single-process ``transformers`` (or, for
``ac`` and ``compile``, against the same model without it, which those tests compare to ``transformers`` elsewhere).
``COVERAGE`` declares, per test (``path::function``), the layouts it trains as sets of the table's axis names (what
its docstring says it runs); the combined layouts (``combined.py``: ``test_combined.py`` at 4 processes, the grid
ones in the 8-process test) and the 8-process test's ``multi_axis()`` layouts come from those lists themselves. A
layout covers every pair of its axes. ``residual_cells`` are the composing cells no declared test covers: none
(``test_coverage.py`` asserts it), so every cell is tested in CI or refused; the opt-in pair matrix
(``tests/composition/test_matrix.py``, ``OSLO_COMPOSITION_MATRIX=1``) trains each cell once more on its own.
"""
from __future__ import annotations

from itertools import combinations

from oslo_models.composition import Layout
from oslo_models.composition.table import multi_axis, pairs
from tests.composition.combined import combined_cells

EIGHT_RANKS = "tests/composition/test_eight_ranks.py::test_multi_axis_layouts_match_transformers"
COMBINED = "tests/composition/test_combined.py::test_combined_layouts_match_transformers"

COVERAGE: dict[str, list[set[str]]] = {
    # zoo (every family; Llama among them): one AdamW step per layout
    "tests/models/test_zoo.py::test_zoo_parity": [
        {"tp", "sp", "dp", "z3"}, {"tp", "dp", "z3"}, {"tp", "pp"}, {"cp", "dp", "z1"}, {"pp"}],
    "tests/parallel_layers/test_context_parallel.py::test_cp2_ring_and_all_to_all_match_transformers": [{"cp"}],
    "tests/parallel_layers/test_context_parallel.py::test_cp4_and_cp2_with_tp_sp_and_zero1_match_transformers": [
        {"cp", "tp", "sp"}, {"cp", "dp", "z1"}],
    "tests/training/test_fsdp_compositions.py::test_fsdp_with_pipeline_context_hsdp_and_resharded_checkpoints": [
        {"pp", "dp", "z1"}, {"pp", "dp", "z2", "off"}, {"pp", "dp", "z3"}, {"cp", "dp", "z3"}, {"dp", "z3"}],
    "tests/reliability/test_zero_families.py::test_zero_stages_match_transformers_for_tied_families": [
        {"dp", "z1"}, {"dp", "z2"}, {"dp", "z3"}, {"dp", "z3", "off"}],
    "tests/models/test_moe_parity.py::test_ep1_matches_transformers": [{"moe"}],
    "tests/models/test_moe_parity.py::test_expert_parallel_layouts_match_transformers_and_save": [
        {"moe", "ep", "dp"}, {"moe", "ep", "dp", "tp", "sp"}, {"moe", "ep", "dp", "pp"}, {"moe", "ep", "dp", "z1"},
        {"moe", "ep", "dp", "z3"}],
    "tests/models/test_compile_models.py::test_compiled_equals_eager_tp1": [{"compile"}],
    "tests/models/test_compile_models.py::test_compiled_equals_eager_tp2": [{"compile", "tp"}],
    "tests/models/test_activation_checkpointing.py::test_modes_match_no_checkpointing_tp1": [{"ac"}, {"ac", "moe"}],
    "tests/models/test_activation_checkpointing.py::test_modes_match_no_checkpointing_tp2": [
        {"ac", "tp"}, {"ac", "tp", "sp"}, {"ac", "pp"}],
    "tests/reliability/test_pipeline_mixed_precision.py::test_bf16_and_fp16_with_pipeline_match_transformers": [
        {"pp", "bf16"}, {"pp", "fp16"}],
    "tests/training/test_accelerate.py::test_accumulation_with_accelerate_equals_double_batch": [{"tp", "dp"}],
    "tests/parallel_layers/test_context_parallel_experts.py::test_cp2_x_ep2_x_dp2_matches_transformers": [
        {"moe", "ep", "cp", "dp"}, {"moe", "ep", "cp", "dp", "z1"}, {"moe", "ep", "cp", "dp", "z3"}],
    "tests/training/test_nvme_offload.py::test_zero3_nvme_offload_equals_in_memory_and_resumes": [
        {"tp", "dp", "z3", "nvme"}, {"moe", "ep", "dp", "z3", "nvme"}],
}


def axes_of(layout: Layout) -> set[str]:
    """The table's axis names a layout turns on."""
    p, found = layout.parallel, set()
    if p.get("tensor_parallel_size", 1) > 1:
        found.add("tp" if p.get("tensor_parallel_mode", "1d") == "1d" else "grid")
    if p.get("sequence_parallel"):
        found.add("sp")
    for key, name in (("pipeline_parallel_size", "pp"), ("context_parallel_size", "cp"),
                      ("expert_parallel_size", "ep"), ("data_parallel_size", "dp")):
        if p.get(key, 1) > 1:
            found.add(name)
    if layout.zero_stage:
        found.add(f"z{layout.zero_stage}")
    if layout.cpu_offload:
        found.add("off")
    if p.get("offload") == "nvme":
        found.add("nvme")
    if p.get("activation_checkpointing"):
        found.add("ac")
    if layout.mixed_precision != "no":
        found.add(layout.mixed_precision)
    if layout.compile:
        found.add("compile")
    if layout.moe:
        found.add("moe")
    return found


def declared() -> dict[str, list[set[str]]]:
    """``COVERAGE`` plus the combined layouts and the 8-process test's composing layouts."""
    eight = [axes_of(c.layout) for c in multi_axis() + combined_cells(8) if c.status == "composes"]
    four = [axes_of(c.layout) for c in combined_cells(4) if c.status == "composes"]
    return {**COVERAGE, COMBINED: four, EIGHT_RANKS: eight}


def covering_tests() -> dict[frozenset, str]:
    """``{cell axes: the first declared test that trains them}`` for every single axis and pair of a declared layout."""
    found: dict[frozenset, str] = {}
    for test, layouts in declared().items():
        for axes in layouts:
            for size in (1, 2):
                for cell_axes in combinations(sorted(axes), size):
                    found.setdefault(frozenset(cell_axes), test)
    return found


def residual_cells() -> list:
    """The composing cells no declared test covers (none: ``test_coverage.py``)."""
    covered = covering_tests()
    return [c for c in pairs() if c.status == "composes" and frozenset(c.axes) not in covered]
