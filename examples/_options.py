"""Render the example scripts' options page (docs/options.md) from their own argparse parsers, so it cannot drift:

    python examples/_options.py --write docs/options.md     # tests/docs/test_options_page.py checks it is current

The shared options (``_common.build_parser``) are listed once, in sections; each script's table holds its own
options and the shared ones whose default it changes.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = ("train_clm", "train_sft", "train_mlm", "train_seq2seq", "train_classification", "train_dpo", "train_grpo",
           "distill")

# Section titles of the shared options, each starting at the option named (build_parser's order is by topic).
SECTIONS = (
    ("--config", "Configuration and planning"),
    ("--model", "Model, tokenizer and data"),
    ("--tp", "Parallel layout"),
    ("--mixed-precision", "Precision"),
    ("--steps", "Optimization"),
    ("--n-layer", "A model built from config"),
    ("--save-every", "Checkpoints and faults"),
    ("--report-to", "Logging and the Hub"),
)

HEADER = """# Example scripts' options

Generated from the scripts' own parsers by `python examples/_options.py --write docs/options.md` (CI checks it is
current). Every script takes the shared options; `--config run.yaml` sets any of them (dashes or underscores), and
flags on the command line win. `--help` prints the same, with the launch examples. The layout is checked before
anything is built: a wrong one is one error line and exit status 2. How the axes combine:
[composition table](composition.md); choosing a layout: [planner](planner.md).
"""


def _parser(script: str) -> argparse.ArgumentParser:
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    return importlib.import_module(script).make_parser()


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions if action.option_strings and action.dest != "help"]


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _row(action: argparse.Action, default) -> str:
    flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
    if action.choices:
        value = " \\| ".join(str(choice) for choice in action.choices)
    elif action.nargs == 0:
        value = "(flag)"
    else:
        value = action.metavar or {int: "int", float: "float"}.get(action.type, "text")
    shown = "" if default is None or default is False or action.nargs == 0 else f"`{default}`"
    return f"| {flags} | {_cell(value)} | {shown} | {_cell(action.help or '')} |"


TABLE = "| option | value | default | what it does |\n|---|---|---|---|"


def render() -> str:
    from _common import build_parser

    shared = _options(build_parser("", output="OUTPUT", model_help="the checkpoint to fine-tune"))
    shared_defaults = {action.dest: (action.default, action.help) for action in shared}
    starts = dict(SECTIONS)
    missing = sorted(set(starts) - {flag for action in shared for flag in action.option_strings})
    if missing:
        raise ValueError(f"SECTIONS names options build_parser no longer has: {missing}")
    lines = [HEADER, "## Shared options"]
    for action in shared:
        title = starts.get(action.option_strings[0])
        if title:
            lines += ["", f"### {title}", "", TABLE]
        lines.append(_row(action, action.default))
    for script in SCRIPTS:
        parser = _parser(script)
        rows = [_row(action, parser.get_default(action.dest)) for action in _options(parser)
                if shared_defaults.get(action.dest) != (parser.get_default(action.dest), action.help)]
        summary = parser.description.strip().split("\n\n")[0]  # the docstring's first paragraph
        lines += ["", f"## `examples/{script}.py`", "", _cell(summary), "", TABLE]
        lines += rows
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    cli = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    cli.add_argument("--write", metavar="PAGE", help="write the page here instead of printing it")
    args = cli.parse_args(argv)
    text = render()
    if args.write:
        with open(args.write, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
