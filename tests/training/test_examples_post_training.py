"""Smoke runs of examples/train_dpo.py, train_grpo.py and distill.py: 2 steps over 2 CPU processes at tp 2 (the frozen
reference / teacher at its own layout, tp 1 over the same processes, in one run of each), each writing a loss curve
of finite losses and a Hub folder that plain ``transformers`` loads. DPO's first loss is log 2 (dropout off, the
policy equals its reference); a pipelined layout is refused with the reason, before anything is built."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import transformers

from tests.helpers import examples

TINY = ("--steps", "2", "--n-embd", "64", "--batch-size", "2")


@pytest.mark.parametrize("script, extra", [
    ("train_dpo.py", ("--seq-len", "24", "--prompt-len", "8", "--ref-tp", "1")),
    ("train_grpo.py", ("--beta", "0.04", "--num-generations", "2", "--loss-type", "dapo")),
    ("distill.py", ("--seq-len", "24", "--teacher-tp", "1", "--top-k", "8", "--kd-direction", "reverse")),
], ids=["dpo", "grpo", "distill"])
def test_post_training_example_smoke(tmp_path, script, extra):
    out = tmp_path / "out"
    examples.launch(examples.torchrun(2), script, "--tp", "2", *TINY, *extra, "--output", str(out), timeout=300)
    losses = json.loads((out / "loss.json").read_text())["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    if script == "train_dpo.py":
        assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    transformers.AutoTokenizer.from_pretrained(out / "model")


def test_post_training_examples_refuse_pipeline(tmp_path):
    """One line and exit status 2, before any process group or model."""
    result = subprocess.run([sys.executable, os.path.join(examples.EXAMPLES, "train_dpo.py"), "--pp", "2", "--output",
                             str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=examples.ROOT,
                            env=dict(os.environ, PYTHONPATH=examples.ROOT, OMP_NUM_THREADS="1"))
    assert result.returncode == 2 and "pipeline schedule" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
