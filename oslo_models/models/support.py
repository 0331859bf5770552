"""The support matrix: for every family record, which parallel axes its models take, read from the validation code.

Nothing here is written by hand per family: each record's main class is asked through ``om.capabilities`` (the checks
``from_pretrained`` runs before any process group exists: ``validate_parallel_config``, the context-parallel check,
the pipeline adapter) whether it accepts a small layout of each axis for the record's tiny config. A refusal is shown
with the reason the user would get. The table in README.md and docs/models.md is this module's output (``python -m
oslo_models.models.support`` prints it; ``--write README.md docs/models.md`` replaces the table between their markers; a
test keeps them equal).

Options a config turns on (Falcon's ALiBi, Gemma 2's soft-capping) decide some refusals, so the matrix is for each
record's tiny test config, which turns its family's particulars on.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from .registry import families

#: column -> the ``om.capabilities`` feature it shows
AXES = {"tp": "tensor_parallel", "sp": "sequence_parallel", "2d/2.5d/3d": "tensor_parallel_grid",
        "pp": "pipeline_parallel", "cp": "context_parallel", "ep": "expert_parallel"}
_START, _END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
_NO_EXPERTS = "has no mixture-of-experts layers"


def support_rows() -> list[dict]:
    """One row per record: ``model_type``, ``classes`` (the record's class names) and ``column -> reason or None``
    (``om.capabilities`` of the record's main class on its tiny config)."""
    from ..generic.capabilities import capabilities

    rows = []
    for record in families():
        found = capabilities(record.model_type, task=record.main_task())
        rows.append(dict(model_type=record.model_type, classes=tuple(record.classes.values()),
                         axes={column: None if found.supports(name) else found[name].why
                               for column, name in AXES.items()}))
    return rows


def _cell(reason: str | None) -> str:
    if reason is None:
        return "yes"
    if _NO_EXPERTS in reason:
        return "-"
    first = reason.replace("|", "/").splitlines()[0].split("; ")[0]  # the reason, not the advice after it
    return "no: " + (first if len(first) <= 120 else first[:117] + "...")


def support_matrix_markdown() -> str:
    """The README table: one row per record, then the generic path's (every ``transformers`` type without a
    record; ``om.capabilities(type)`` gives one type's own row)."""
    lines = [f"| type | classes | {' | '.join(AXES)} |", "|---|---|" + "---|" * len(AXES)]
    for row in support_rows():
        classes = ", ".join(f"`{name}`" for name in row["classes"])
        cells = " | ".join(_cell(row["axes"][column]) for column in AXES)
        lines.append(f"| `{row['model_type']}` | {classes} | {cells} |")
    generic = {column: "no" for column in AXES} | {"tp": "its `base_model_tp_plan`, if it has one",
                                                   "sp": "with tp, where every layer splits around the plan",
                                                   "pp": "causal LMs: decoder layers cut into stages, with dp / "
                                                         "ZeRO / tp + SP / cp / ep",
                                                   "cp": "causal LMs attending through the attention interface",
                                                   "ep": "its `base_model_ep_plan`, with tp / SP / ZeRO"}
    lines.append(f"| any other type: generic path | `transformers`' own | {' | '.join(generic.values())} |")
    return "\n".join(lines)


def replace_in(text: str, table: str) -> str:
    """``text`` with the table between the support-matrix markers replaced by ``table``."""
    pattern = re.compile(re.escape(_START) + r".*?" + re.escape(_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {_START} ... {_END} markers found")
    return pattern.sub(lambda _: f"{_START}\n{table}\n{_END}", text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--write", metavar="FILE", nargs="+",
                        help="replace the table between the markers of these files (README.md docs/models.md)")
    args = parser.parse_args(argv)
    table = support_matrix_markdown()
    for path in map(Path, args.write or ()):
        path.write_text(replace_in(path.read_text(encoding="utf-8"), table), encoding="utf-8")
    if args.write:
        return
    print(table)


if __name__ == "__main__":
    main()
