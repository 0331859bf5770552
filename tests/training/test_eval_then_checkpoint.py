"""An evaluation (no-grad forwards) right before a checkpoint at ZeRO-3: ``examples/train_clm.py --zero 3`` under
torchrun at dp 2 evaluates ``--eval-data`` every 2 steps and saves every 2 steps. A no-grad forward leaves the FSDP2
root's parameters gathered (no backward reshards them); ``save_checkpoint`` reshards every unit first
(``training.checkpoint.reshard_fsdp_units``). Without that both ranks died with SIGSEGV in the first save after an
evaluation (seen before the fix: exit code -11). Asserts the run ends, both checkpoints and both evaluations exist,
and the resumed run from step 2 logs step 3 and 4's losses exactly as the uninterrupted one did."""
from __future__ import annotations

import json

from oslo_models import training
from tests.helpers import examples


def test_evaluation_then_checkpoint_at_zero3(tmp_path):
    def run(out, *extra):
        examples.launch(examples.torchrun(2), "train_clm.py", "--zero", "3", *examples.TINY, "--steps", "4",
                        "--output", str(out), "--eval-data", examples.eval_file(tmp_path), "--eval-every", "2",
                        "--eval-samples", "16", "--save-every", "2", *extra)
        return json.loads((out / "loss.json").read_text())

    out = tmp_path / "out"
    report = run(out)
    assert [entry["step"] for entry in report["eval"]] == [2, 4]
    assert training.find_checkpoint(out / "checkpoint") == str(out / "checkpoint" / "step-00000004")
    assert (out / "checkpoint" / "step-00000002").is_dir()
    stopped = tmp_path / "stopped"
    run(stopped, "--stop-at", "2")
    resumed = run(stopped, "--resume")
    assert resumed["losses"] == report["losses"]
