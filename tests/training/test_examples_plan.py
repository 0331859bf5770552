"""``--plan auto`` and ``--global-batch-size`` in the example scripts, parsed in process (no launch): the layout and
batch split are the planner's best candidate for the world in the environment, a tighter memory cap moves the
choice to a layout that fits it, nothing fitting is one ``UsageError`` naming the smallest reachable memory, and a
fixed layout splits the global batch over its data-parallel size."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

import oslo_models as om
from oslo_models.planner.search import SearchSpace

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
TINY = ("--seq-len", "32", "--n-embd", "64", "--n-layer", "2", "--vocab-size", "128")


@pytest.fixture(scope="module")
def clm():
    import importlib

    sys.path.insert(0, EXAMPLES)
    try:
        yield importlib.import_module("_common"), importlib.import_module("train_clm")
    finally:
        sys.path.remove(EXAMPLES)


def _launch(clm, monkeypatch, *argv, world=4):
    """``check_launch`` of train_clm.py as rank 0 of ``world`` processes on one node: ``(args, ParallelConfig)``."""
    common, script = clm
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    args = script.parse_args([*TINY, *argv])
    return args, common.check_launch(args, om.AutoModelForCausalLM, script.gpt2_config)


def _best(clm, args, world, cap):
    config = clm[1].gpt2_config(args, 128)
    result = om.plan((om.AutoModelForCausalLM.model_class_for(config), config), world_size=world,
                     memory_per_device=cap, global_batch=16, seq_len=32, space=SearchSpace(mixed_precision="no"))
    return result


def test_plan_auto_sets_the_best_layout_and_batch(clm, monkeypatch):

    args, cfg = _launch(clm, monkeypatch, "--plan", "auto", "--global-batch-size", "16", "--memory-per-device",
                        "4GB")
    best = _best(clm, args, 4, 4e9).candidates[0]
    expected = best.parallel_config
    for field in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "zero_stage",
                  "data_parallel_shard_size", "activation_checkpointing", "sequence_parallel"):
        assert getattr(cfg, field) == getattr(expected, field), field
    dp = cfg.resolve_data_parallel_size(4)
    assert args.batch_size * args.grad_accum * dp == 16
    assert (args.batch_size, args.grad_accum) == (best.micro_batch, best.num_microbatches)

    # a cap below the unconstrained choice's memory: the launch takes a layout that fits it
    loose = best.memory.total
    tight = _best(clm, args, 4, 0.8 * loose).candidates[0]
    args, cfg = _launch(clm, monkeypatch, "--plan", "auto", "--global-batch-size", "16", "--memory-per-device",
                        str(int(0.8 * loose)))
    assert tight.memory.total <= 0.8 * loose and cfg.zero_stage == tight.parallel_config.zero_stage
    assert args.batch_size * args.grad_accum * cfg.resolve_data_parallel_size(4) == 16

    # nothing fits: one error with the smallest memory any layout reaches
    with pytest.raises(Exception, match="no layout of 4 processes .* smallest any layout reaches"):
        _launch(clm, monkeypatch, "--plan", "auto", "--global-batch-size", "16", "--memory-per-device", "10KB")
    # host RAM shared by the node's processes when no cap is given (CPU)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert sys.modules["_plan"].device_memory(argparse.Namespace(memory_per_device=None)) == ram // 2


def test_plan_and_global_batch_options_refused_or_split(clm, monkeypatch):

    for argv, message in [(("--plan", "auto"), "needs --global-batch-size"),
                          (("--plan", "auto", "--global-batch-size", "8", "--tp", "2"), "drop --tp"),
                          (("--plan", "auto", "--global-batch-size", "8", "--parallel-config", "x.json"),
                           "drop --parallel-config"),
                          (("--global-batch-size", "8", "--grad-accum", "2"), "sets --grad-accum")]:
        with pytest.raises(SystemExit):
            _launch(clm, monkeypatch, *argv)
    # a fixed layout: the global batch over dp (tp2 x dp2), micro-batch the largest divisor within --batch-size
    args, _ = _launch(clm, monkeypatch, "--tp", "2", "--global-batch-size", "12", "--batch-size", "4")
    assert (args.batch_size, args.grad_accum) == (3, 2)
    args, _ = _launch(clm, monkeypatch, "--pp", "2", "--global-batch-size", "12")  # pipeline: one replica batch
    assert (args.batch_size, args.grad_accum) == (6, 1)
    with pytest.raises(Exception, match="does not split over the data-parallel size 4"):
        _launch(clm, monkeypatch, "--global-batch-size", "6")
    with pytest.raises(Exception, match="generic path"):
        _launch(clm, monkeypatch, "--plan", "auto", "--global-batch-size", "8", "--model-type", "mamba")
