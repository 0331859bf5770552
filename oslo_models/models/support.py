"""The support matrix: for every family record, which parallel axes its models take, read from the validation code.

Nothing here is written by hand per family: each record's model class is asked, the way ``from_pretrained`` asks it
before any process group exists (``validate_parallel_config``, the context-parallel check and the pipeline
adapter), whether it accepts a small layout of each axis for the record's tiny config. A refusal is shown with the
reason the user would get. The README's table is this module's output (``python -m oslo_models.models.support``
prints it; ``--write README.md`` replaces the table between its markers; a test keeps the two equal).

Options a config turns on (Falcon's ALiBi, Gemma 2's soft-capping) decide some refusals, so the matrix is for each
record's tiny test config, which turns its family's particulars on.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from ..config import ParallelConfig
from .registry import families

#: axis -> the smallest layout that uses it
AXES = {
    "tp": dict(tensor_parallel_size=2),
    "sp": dict(tensor_parallel_size=2, sequence_parallel=True),
    "pp": dict(pipeline_parallel_size=2),
    "cp": dict(context_parallel_size=2),
    "ep": dict(expert_parallel_size=2),
}
_MAIN_TASKS = ("masked_lm", "causal_lm", "seq2seq_lm", "base")  # an encoder's main head is its masked LM
_START, _END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def _main_class(record):
    task = next(task for task in _MAIN_TASKS if task in record.classes)
    return record.model_class(task)


def _tiny_config(record):
    import transformers

    if record.model_type in transformers.CONFIG_MAPPING:
        return transformers.AutoConfig.for_model(record.model_type, **dict(record.tiny_config))
    return record.config_class()(**dict(record.tiny_config))


def axis_refusal(model_class, config, axis: str) -> str | None:
    """The reason ``model_class`` refuses ``axis`` for ``config`` (before any collective), or ``None``."""
    from .common.context_parallel import check_context_parallel

    if axis == "ep" and not (getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0)):
        return "no experts"
    parallel = ParallelConfig(**AXES[axis])
    try:
        model_class.validate_parallel_config(config, parallel)
        check_context_parallel(model_class, config, parallel)
        if axis == "pp" and getattr(model_class, "pipeline_adapter", None) is None:
            return f"{model_class.__name__} has no pipeline stages"
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return None


def support_rows() -> list[dict]:
    """One row per record: ``model_type``, ``classes`` (the record's class names) and ``axis -> reason or None``."""
    rows = []
    for record in families():
        model_class, config = _main_class(record), _tiny_config(record)
        rows.append(dict(model_type=record.model_type, classes=tuple(record.classes.values()),
                         axes={axis: axis_refusal(model_class, config, axis) for axis in AXES}))
    return rows


def _cell(reason: str | None) -> str:
    if reason is None:
        return "yes"
    if reason == "no experts":
        return "-"
    first = reason.replace("|", "/").splitlines()[0].split("; ")[0]  # the reason, not the advice after it
    return "no: " + (first if len(first) <= 120 else first[:117] + "...")


def support_matrix_markdown() -> str:
    """The README table (also lists ZeRO 1-3 and activation checkpointing: every family takes them)."""
    lines = [f"| type | classes | {' | '.join(AXES)} |", "|---|---|" + "---|" * len(AXES)]
    for row in support_rows():
        classes = ", ".join(f"`{name}`" for name in row["classes"])
        cells = " | ".join(_cell(row["axes"][axis]) for axis in AXES)
        lines.append(f"| `{row['model_type']}` | {classes} | {cells} |")
    return "\n".join(lines)


def replace_in(text: str, table: str) -> str:
    """``text`` with the table between the support-matrix markers replaced by ``table``."""
    pattern = re.compile(re.escape(_START) + r".*?" + re.escape(_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {_START} ... {_END} markers found")
    return pattern.sub(lambda _: f"{_START}\n{table}\n{_END}", text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--write", metavar="README", help="replace the table between the markers of this file")
    args = parser.parse_args(argv)
    table = support_matrix_markdown()
    if args.write:
        path = Path(args.write)
        path.write_text(replace_in(path.read_text(encoding="utf-8"), table), encoding="utf-8")
    else:
        print(table)


if __name__ == "__main__":
    main()
