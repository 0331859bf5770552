"""The composition table: every pair of axes, composed or refused, generated from ``check_layout``.

Cells are decided on two representative families, built from their records' tiny configs: the dense decoder
(``llama``) for every pair, and the mixture-of-experts decoder (``mixtral``) for the pairs with ``moe`` (an MoE
model, experts replicated) or ``ep`` (experts split). A cell is:

- ``composes``: ``check_layout`` accepts it; ``tests/composition/test_matrix.py`` trains that layout against the
  single-process ``transformers`` model (the test runs exactly the composing cells of ``pairs()``);
- ``refused``: the error the code raises, before any process group, with its reason;
- ``exclusive``: the two axes are two values of one option (``tp`` and ``grid``, two ZeRO stages, two dtypes).

``python -m oslo_models.composition --write docs/composition.md`` renders it (a test keeps the file equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .axes import AXES, Axis, Layout, _layout, combine, exclusive
from .check import refusal
from .generic_rows import render_rows

DENSE, MOE = "llama", "mixtral"
MOE_AXIS = Axis("moe", "mixture-of-experts model (experts replicated)", Layout(moe=True))
TABLE_AXES = (*AXES, MOE_AXIS)


@dataclass(frozen=True)
class Cell:
    axes: tuple[str, ...]
    model_type: str
    layout: Layout | None
    status: str  # "composes", "refused" or "exclusive"
    reason: str = ""

    @property
    def name(self) -> str:
        return " x ".join(self.axes)


@lru_cache(maxsize=None)
def representative(model_type: str):
    """``(causal LM class, tiny config)`` of the family the table decides a cell on."""
    import transformers

    from ..models.registry import family_record

    record = family_record(model_type)
    config = transformers.AutoConfig.for_model(model_type, **dict(record.tiny_config))
    return record.model_class("causal_lm"), config


def cell(*names: str) -> Cell:
    """The table's decision for the axes ``names`` together."""
    parallel_names = tuple(name for name in names if name != "moe")
    if (why := exclusive(*parallel_names)) is not None:
        return Cell(names, DENSE, None, "exclusive", why)
    layout = combine(*parallel_names) if parallel_names else Layout()
    model_type = MOE if "moe" in names or layout.moe else DENSE
    reason = refusal(layout, *representative(model_type))
    return Cell(names, model_type, layout, "refused" if reason else "composes", reason or "")


def pairs() -> list[Cell]:
    """Every axis alone, then every pair, in ``TABLE_AXES`` order."""
    names = [axis.name for axis in TABLE_AXES]
    cells = [cell(name) for name in names]
    cells += [cell(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    return cells


# The four- and five-axis layouts at 8 processes that Megatron-Core and torchtitan users run (issue 30's list):
# ``tests/composition/test_eight_ranks.py`` trains the composing ones; the refused ones give their reason here.
_MB = dict(num_microbatches=2)
MULTI_AXIS = {
    "tp x sp x cp x pp": _layout(tensor_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                                 pipeline_parallel_size=2, **_MB),
    "tp x pp x dp x z1": _layout(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                                 zero_stage=1, **_MB),
    "tp x pp x dp x z3": _layout(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                                 zero_stage=3, **_MB),
    "tp x cp x dp x z3": _layout(tensor_parallel_size=2, context_parallel_size=2, data_parallel_size=2,
                                 zero_stage=3),
    "tp x dp x z3 (hsdp)": _layout(tensor_parallel_size=2, data_parallel_size=4, data_parallel_shard_size=2,
                                   zero_stage=3),
    "tp x pp x ep": _layout(moe=True, tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                            expert_parallel_size=2, pipeline_schedule="gpipe", num_microbatches=1),
    "ep x cp x tp": _layout(moe=True, tensor_parallel_size=2, context_parallel_size=2, data_parallel_size=2,
                            expert_parallel_size=2),
    "grid x cp": _layout(tensor_parallel_size=4, tensor_parallel_mode="2d", context_parallel_size=2),
    "grid x cp (all-to-all)": _layout(tensor_parallel_size=4, tensor_parallel_mode="2d", context_parallel_size=2,
                                      context_parallel_mode="all_to_all"),
    "grid x pp": _layout(tensor_parallel_size=4, tensor_parallel_mode="2d", pipeline_parallel_size=2, **_MB),
}


def multi_axis() -> list[Cell]:
    """``MULTI_AXIS``, each decided by ``check_layout`` like a pair."""
    cells = []
    for name, layout in MULTI_AXIS.items():
        model_type = MOE if layout.moe else DENSE
        reason = refusal(layout, *representative(model_type))
        cells.append(Cell(tuple(name.split(" x ")), model_type, layout, "refused" if reason else "composes",
                          reason or ""))
    return cells


def counts(cells: list[Cell]) -> dict[str, int]:
    found = {"composes": 0, "refused": 0, "exclusive": 0}
    for c in cells:
        found[c.status] += 1
    return found


def render(cells: list[Cell] | None = None) -> str:
    """The markdown page: the axes, the matrix (C composes, R refused, - exclusive) and every refusal's reason."""
    cells = pairs() if cells is None else cells
    names = [axis.name for axis in TABLE_AXES]
    status = {frozenset(c.axes): c for c in cells}
    mark = {"composes": "C", "refused": "**R**", "exclusive": "-"}
    pair_cells = [c for c in cells if len(c.axes) == 2]
    total = counts(pair_cells)
    lines = [
        "# What composes with what",
        "",
        "Generated by `python -m oslo_models.composition --write docs/composition.md` from the validation code "
        "itself (`oslo_models/composition/check.py`); do not edit by hand.",
        "",
        f"Pairs: {len(pair_cells)}; **{total['composes']} compose** (accepted by the validation; "
        f"`tests/composition/test_matrix.py` trains each against single-process `transformers`), "
        f"**{total['refused']} are refused** before any process group with the reason below, {total['exclusive']} "
        "are two values of one option.",
        "",
        "Cells are decided on the tiny Llama (dense) and, for `moe` and `ep`, the tiny Mixtral.",
        "",
        "| axis | what it turns on | its smallest layout |",
        "|---|---|---|",
    ]
    for axis in TABLE_AXES:
        lines.append(f"| `{axis.name}` | {axis.description} | {axis.layout.describe()} |")
    lines += ["", "| | " + " | ".join(f"`{n}`" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for i, a in enumerate(names):
        row = []
        for j, b in enumerate(names):
            if j < i:
                row.append("")
            elif j == i:
                row.append(mark[status[frozenset((a,))].status] + "ᵃ")
            else:
                row.append(mark[status[frozenset((a, b))].status])
        lines.append(f"| `{a}` | " + " | ".join(row) + " |")
    lines += ["", "ᵃ the axis alone.", "", "## Refused, with the reason the code gives", "",
              "| axes | layout | family | reason |", "|---|---|---|---|"]
    for c in cells:
        if c.status == "refused":
            reason = c.reason.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {c.name} | {c.layout.describe()} | {c.model_type} | {reason} |")
    lines += ["", "## Composes: the layout each cell trains", "", "| axes | layout | family |", "|---|---|---|"]
    for c in cells:
        if c.status == "composes":
            lines.append(f"| {c.name} | {c.layout.describe()} | {c.model_type} |")
    lines += ["", "## Four and five axes at 8 processes", "",
              "`tests/composition/test_eight_ranks.py` trains each composing layout against single-process "
              "`transformers` (3 AdamW steps, fp32: every loss and every parameter).", "",
              "| axes | layout | family | status |", "|---|---|---|---|"]
    for c in multi_axis():
        status = "composes" if c.status == "composes" else "refused: " + c.reason.replace("|", "\\|").replace(
            "\n", " ")
        lines.append(f"| {c.name} | {c.layout.describe()} | {c.model_type} | {status} |")
    lines += render_rows()  # the generic path's rows (generic_rows.py)
    return "\n".join(lines) + "\n"
