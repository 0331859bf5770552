"""Partitioning, pipeline config errors, and the schedule plot / CLI (single process, no collectives)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import oslo_models as om
from oslo_models.pipeline.partition import partition_by_cost, partition_layers, stages_of_rank
from oslo_models.pipeline.plot import bubble_fraction, schedule_actions, timeline, write_schedule_plot


def test_uniform_split_and_its_error():
    assert partition_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="cannot be split evenly"):
        partition_layers(6, 4)
    with pytest.raises(ValueError, match="fewer than"):
        partition_layers(3, 4)


def test_balanced_and_explicit_split():
    # Heavy embeddings on the first stage push layers to the later stages.
    assert partition_by_cost([1.0] * 8, 2, first_extra=2.0) == (3, 5)
    assert partition_by_cost([1, 1, 1, 5], 2) == (3, 1)
    assert partition_layers(8, 2, (3, 5)) == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError, match="sum to"):
        partition_layers(8, 2, (3, 4))
    assert stages_of_rank(1, 4, 2) == [1, 5]


@pytest.mark.parametrize("bad,match", [
    (dict(pipeline_parallel_size=4, num_microbatches=2, pipeline_schedule="1f1b"), "num_microbatches >= "),
    (dict(pipeline_parallel_size=2, virtual_pipeline_size=2, pipeline_schedule="1f1b"), "virtual_pipeline_size"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b"), "virtual_pipeline_size >= 2"),
    (dict(pipeline_parallel_size=4, num_microbatches=9, virtual_pipeline_size=2, pipeline_schedule="zero_bubble"),
     "multiple of"),
    (dict(pipeline_parallel_size=2, pipeline_partition=(1, 2, 3)), "has 3 stage"),
    (dict(pipeline_parallel_size=2, pipeline_partition="fast"), "unknown"),
])
def test_pipeline_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        om.ParallelConfig(**bad)


def test_partition_round_trips_through_json():
    cfg = om.ParallelConfig(pipeline_parallel_size=2, pipeline_partition=(3, 5))
    assert om.ParallelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("schedule,pp,m,v,expected", [
    ("gpipe", 4, 8, 1, 3 / 11), ("1f1b", 4, 8, 1, 3 / 11), ("1f1b", 2, 4, 1, 1 / 5),
    ("interleaved_1f1b", 4, 8, 2, 3 / 19),  # (p-1)/(v*m+p-1)
])
def test_schedule_timeline_bubble_matches_theory(schedule, pp, m, v, expected):
    actions = schedule_actions(schedule, pp, m, v)
    assert sum(len(row) for row in actions) == 2 * m * pp * v  # every microbatch forward and backward, each stage
    assert bubble_fraction(timeline(actions)) == pytest.approx([expected] * pp)


def test_zero_bubble_beats_1f1b():
    zb = bubble_fraction(timeline(schedule_actions("zero_bubble", 4, 8, 2)))
    assert max(zb) < 3 / 19


def test_plot_files_and_cli(tmp_path):
    svg = write_schedule_plot(tmp_path / "s.svg", "zero_bubble", 2, 4, 2)
    text = open(svg, encoding="utf-8").read()
    assert text.startswith("<svg") and "W0s0" in text and "I3s3" in text
    pytest.importorskip("PIL")
    out = tmp_path / "p.png"
    done = subprocess.run([sys.executable, "-m", "oslo_models", "pipeline-plot", "--pp", "4", "--microbatches", "8",
                           "--schedule", "1f1b", "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "oslo_models", "pipeline-plot", "--pp", "4", "--microbatches", "2",
                          "--schedule", "1f1b", "-o", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "num_microbatches" in bad.stderr
