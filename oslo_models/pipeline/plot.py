"""Draw a pipeline schedule: the action lists of the torch schedule class that ``PipelineRunner`` runs.

``schedule_actions(schedule, pp, microbatches, virtual)`` instantiates the same torch schedule class the runner
uses (``runner.schedule_class``), with the same microbatch count and stages per rank, on stand-in stages (no
process group is needed to compute an order), and returns its ``pipeline_order``: per pipeline rank, the compute
actions in order (``F``: forward, ``B``: full backward, ``I``/``W``: input/weight halves of a split backward).

``timeline`` places them in time with the pipeline's data dependencies (forward 1 unit, full backward 2, ``I``
and ``W`` 1 each), which shows the bubbles; ``write_schedule_plot`` draws one row per rank. SVG is written with
no extra dependency; PNG needs Pillow.
"""
from __future__ import annotations

import os
from unittest import mock

from torch.distributed.pipelining import PipelineStage

from .runner import MULTI_STAGE_SCHEDULES, schedule_class

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868", "FULL_BACKWARD": "#DD8452",
           "FORWARD": "#4C72B0", "BACKWARD_INPUT": "#C44E52", "BACKWARD_WEIGHT": "#55A868"}
_WIDTHS = {"F": 1, "B": 2, "I": 1, "W": 1}
_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}


def _kind(action) -> str:
    text = str(action.computation_type)
    mapping = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    for key, short in mapping.items():
        if text.endswith(key):
            return short
    return text[-1]


def schedule_actions(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list]:
    """Per-rank compute actions, in execution order, of the torch schedule ``PipelineRunner`` runs."""
    from ..config import ParallelConfig

    # Same validation as a real run (microbatches vs stages, virtual stages vs schedule).
    ParallelConfig(pipeline_parallel_size=pp, pipeline_schedule=schedule, num_microbatches=microbatches,
                   virtual_pipeline_size=virtual)
    cls = schedule_class(schedule)
    # Stand-in stages: computing the order reads only the group size/rank and the number of stages. A plain
    # spec'd mock (not create_autospec, ~10x slower): the planner builds one per schedule shape it ranks.
    stand_in = mock.NonCallableMagicMock(spec=PipelineStage)
    stand_in.group_rank, stand_in.group_size, stand_in.submod = 0, pp, None
    stand_in.num_stages = pp * virtual
    if schedule in MULTI_STAGE_SCHEDULES:
        instance = cls([stand_in] * virtual, microbatches)
    else:
        instance = cls(stand_in, microbatches)
    actions = [[a for a in instance.pipeline_order[rank] if a is not None and _kind(a) in _WIDTHS]
               for rank in range(pp)]
    if schedule not in MULTI_STAGE_SCHEDULES:
        # GPipe and 1F1B run their own loops, which take forwards and backwards in microbatch order on every
        # rank; torch 2.13's descriptive order for them numbers the last rank's forwards from 1, so renumber.
        for rank_actions in actions:
            counters = {"F": 0, "B": 0}
            for i, action in enumerate(rank_actions):
                kind = _kind(action)
                rank_actions[i] = action._replace(microbatch_index=counters[kind])
                counters[kind] += 1
    return actions


def timeline(actions: list[list]) -> list[list[tuple[float, float, str, str]]]:
    """Per rank: (start, width, kind, label) of each action, simulated with the pipeline's dependencies.

    Each rank runs its actions in order; an action starts when the rank is free and its inputs exist: a forward
    needs the previous stage's forward of that microbatch, a backward (``B``/``I``) the next stage's backward
    (or this stage's forward on the last stage), ``W`` this stage's ``I``. Communication is taken as free.
    """
    num_stages = 1 + max(a.stage_index for row in actions for a in row)
    done: dict[tuple, float] = {}
    clocks = [0.0] * len(actions)
    cursors = [0] * len(actions)
    rows: list[list] = [[] for _ in actions]

    def needs(action):
        kind, stage, mb = _kind(action), action.stage_index, action.microbatch_index
        if kind == "F":
            return [("F", stage - 1, mb)] if stage > 0 else []
        if kind in ("B", "I"):
            return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < num_stages - 1 else [])
        return [("I", stage, mb)]

    remaining = sum(len(row) for row in actions)
    while remaining:
        progressed = False
        for rank, row in enumerate(actions):
            while cursors[rank] < len(row):
                action = row[cursors[rank]]
                deps = needs(action)
                if not all(d in done for d in deps):
                    break
                kind = _kind(action)
                start = max([clocks[rank]] + [done[d] for d in deps])
                width = _WIDTHS[kind]
                end = start + width
                key = (kind, action.stage_index, action.microbatch_index)
                done[key] = end
                if kind in ("B", "I"):  # either kind of input-gradient unblocks the previous stage
                    done[("B", action.stage_index, action.microbatch_index)] = end
                clocks[rank] = end
                rows[rank].append((start, width, kind, f"{kind}{action.microbatch_index}s{action.stage_index}"))
                cursors[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("The schedule's actions cannot complete (inconsistent order)")
    return rows


def bubble_fraction(rows) -> list[float]:
    """Per rank: idle time / makespan of a ``timeline``."""
    span = max(start + width for row in rows for start, width, *_ in row)
    return [1 - sum(width for _, width, *_ in row) / span for row in rows]


def _svg(rows, title: str, unit: int = 28, height: int = 30) -> str:
    left, top = 70, 40
    span = max((start + width for row in rows for start, width, *_ in row), default=1)
    width_px, height_px = int(left + span * unit + 20), top + len(rows) * (height + 6) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width_px}" height="{height_px}" '
           f'font-family="DejaVu Sans, sans-serif" font-size="9">',
           '<rect width="100%" height="100%" fill="white"/>', f'<text x="{left}" y="20" font-size="13">{title}</text>']
    for rank, row in enumerate(rows):
        y = top + rank * (height + 6)
        out.append(f'<text x="5" y="{y + height / 2 + 4}" font-size="11">rank {rank}</text>')
        for start, width, kind, label in row:
            x = left + start * unit
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{width * unit - 1:.1f}" height="{height}" '
                       f'fill="{_COLORS.get(kind, "#888")}" stroke="black" stroke-width="0.5"/>')
            out.append(f'<text x="{x + width * unit / 2:.1f}" y="{y + height / 2 + 3}" text-anchor="middle" '
                       f'fill="white">{label}</text>')
    y = top + len(rows) * (height + 6) + 15
    kinds = sorted({kind for row in rows for _, _, kind, _ in row}, key="FBIW".index)
    for i, kind in enumerate(kinds):
        x = left + i * 130
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{_COLORS[kind]}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 10}" font-size="11">{_NAMES[kind]}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _png(rows, title: str, path: str, unit: int = 28, height: int = 30) -> None:
    try:
        from PIL import Image, ImageDraw
    except ImportError as error:
        raise ValueError("Writing PNG needs Pillow (pip install pillow); write an .svg instead") from error
    left, top = 70, 40
    span = max((start + width for row in rows for start, width, *_ in row), default=1)
    image = Image.new("RGB", (int(left + span * unit + 20), top + len(rows) * (height + 6) + 20), "white")
    draw = ImageDraw.Draw(image)
    draw.text((left, 12), title, fill="black")
    for rank, row in enumerate(rows):
        y = top + rank * (height + 6)
        draw.text((5, y + height / 2 - 5), f"rank {rank}", fill="black")
        for start, width, kind, label in row:
            x = left + start * unit
            draw.rectangle([x, y, x + width * unit - 2, y + height], fill=_COLORS.get(kind, "#888888"),
                           outline="black")
            draw.text((x + 2, y + height / 2 - 5), label, fill="white")
    image.save(path)


def write_schedule_plot(path: str | os.PathLike, schedule: str, pp: int, microbatches: int,
                        virtual: int = 1) -> str:
    """Draw the schedule to ``path`` (``.svg`` or ``.png``); returns the path written."""
    path = os.fspath(path)
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".svg", ".png"):
        raise ValueError(f"pipeline plot path must end in .svg or .png, got {path!r}")
    rows = timeline(schedule_actions(schedule, pp, microbatches, virtual))
    title = f"{schedule}: pp={pp}, microbatches={microbatches}" + (f", virtual={virtual}" if virtual > 1 else "")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if extension == ".svg":
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(_svg(rows, title))
    else:
        _png(rows, title, path)
    return path
