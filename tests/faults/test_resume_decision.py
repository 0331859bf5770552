"""examples' ``--resume`` never silently starts fresh over a checkpoint folder it cannot use (a crash left only a
partial save): it refuses; with no checkpoint folder at all it says loudly that it starts fresh."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

import oslo_models as om
from tests.helpers.models import tiny_gpt2_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))  # the scripts import it as a sibling module
    import _common

    yield _common
    sys.modules.pop("_common", None)


def run_loop(common, output):
    printed = []
    accelerator = SimpleNamespace(print=printed.append, scaler=None, device="cpu", is_main_process=True)
    args = SimpleNamespace(output=str(output), resume=True, steps=0, stop_at=0, save_every=0, grad_accum=1,
                           max_grad_norm=0.0)
    model = om.AutoModelForCausalLM.from_config(tiny_gpt2_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step, _ = common.resume(args, accelerator, model, optimizer, None, None)
    if step == 0 and not os.path.exists(os.path.join(output, "checkpoint")):  # what the loop's first save writes
        om.training.save_checkpoint(os.path.join(output, "checkpoint"), model, optimizer, step=0)
    return step, printed


def test_resume_refuses_an_unusable_checkpoint(common, tmp_path):
    (tmp_path / "checkpoint" / ".step-00000004.partial").mkdir(parents=True)  # what a kill mid-save leaves
    with pytest.raises(FileNotFoundError, match=r"no complete .* only interrupted saves: \['.step-00000004.partial'\]"):
        run_loop(common, tmp_path)
    assert os.listdir(tmp_path / "checkpoint") == [".step-00000004.partial"]  # nothing overwritten


def test_resume_without_checkpoint_starts_fresh_loudly(common, tmp_path):
    step, printed = run_loop(common, tmp_path)
    assert step == 0 and any("STARTING FRESH" in line for line in printed), printed
    step, printed = run_loop(common, tmp_path)  # the save at the end of the first run is found and used
    assert any("resumed at step 0" in line for line in printed), printed
