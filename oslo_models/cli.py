"""``python -m oslo_models <command>`` / the ``oslo-models`` console script.

Commands:
    pipeline-plot   draw the pipeline schedule the runner executes (SVG or PNG)
    plan            rank parallel layouts by predicted step time under a memory cap (``planner/cli.py``)
    checkpoint      consolidate a training checkpoint into a Hub folder; verify a folder
                    (``conversion/checkpoint_cli.py``)
"""
from __future__ import annotations

import argparse
import sys


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default (when it has one) and descriptions kept as written."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _pipeline_plot(args: argparse.Namespace) -> int:
    from .pipeline.plot import write_schedule_plot

    output = args.output or f"pipeline_{args.schedule}_pp{args.pp}_m{args.microbatches}.svg"
    path = write_schedule_plot(output, args.schedule, args.pp, args.microbatches, args.virtual_stages)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .config import PIPELINE_SCHEDULES

    parser = argparse.ArgumentParser(prog="oslo-models", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("pipeline-plot", help="draw a pipeline schedule timeline (SVG/PNG)",
                               formatter_class=HelpFormatter)
    plot.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    plot.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    plot.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default="1f1b", help="pipeline schedule")
    # --virtual-stages as in the example scripts (ParallelConfig.virtual_pipeline_size); --virtual kept as alias
    plot.add_argument("--virtual-stages", "--virtual", type=int, default=1,
                      help="stages per rank (interleaved_1f1b, zero_bubble)")
    plot.add_argument("--output", "-o", help="file ending in .svg or .png (default: an .svg named after the run)")
    plot.set_defaults(handler=_pipeline_plot)
    from .planner.cli import add_parser as add_plan_parser

    add_plan_parser(commands, HelpFormatter)
    from .conversion.checkpoint_cli import add_parser as add_checkpoint_parser

    add_checkpoint_parser(commands, HelpFormatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        parser.error(str(error))
    return 2


if __name__ == "__main__":
    sys.exit(main())
