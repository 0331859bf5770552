"""examples' ``--resume`` never silently starts fresh over a checkpoint folder it cannot use (a crash left only a
partial save): it refuses; with no checkpoint folder at all it says loudly that it starts fresh. After an elastic
restart (``TORCHELASTIC_RESTART_COUNT`` > 0) the same command resumes without the flag (negative control: the same
call on a first attempt starts at step 0, which is what a restarted job without it would silently do). A corrupt
newest checkpoint falls back to the previous one, loudly."""
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
    for name in ("_common", "_data", "_report"):  # _common imports the others: leave none bound to it
        sys.modules.pop(name, None)


def run_loop(common, output, resume=True):
    printed = []
    accelerator = SimpleNamespace(print=printed.append, scaler=None, device="cpu", is_main_process=True)
    args = SimpleNamespace(output=str(output), resume=resume, steps=0, stop_at=0, save_every=0, grad_accum=1,
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


def _saved(output, steps):
    torch.manual_seed(0)
    model = om.AutoModelForCausalLM.from_config(tiny_gpt2_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        om.training.save_checkpoint(os.path.join(output, "checkpoint"), model, optimizer, step=step, keep=2)


def test_elastic_restart_resumes_without_the_flag(common, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    _saved(tmp_path, [3])
    step, printed = run_loop(common, tmp_path, resume=False)
    assert step == 0 and not printed  # a first attempt without --resume starts fresh (what a restart must not do)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    step, printed = run_loop(common, tmp_path, resume=False)
    assert step == 3 and any("resumed at step 3" in line and "elastic restart #1" in line for line in printed)
    # the first attempt died during its first save: only a partial folder; the restart starts fresh, loudly
    partial_only = tmp_path / "partial"
    (partial_only / "checkpoint" / ".step-00000002.partial").mkdir(parents=True)
    step, printed = run_loop(common, partial_only, resume=False)
    assert step == 0 and any("elastic restart #1" in line and "STARTING FRESH" in line for line in printed)


def test_resume_falls_back_from_a_corrupt_checkpoint(common, tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    _saved(tmp_path, [2, 4])
    trainer_state = tmp_path / "checkpoint" / "step-00000004" / "trainer_state.pt"
    os.truncate(trainer_state, os.path.getsize(trainer_state) - 1)
    step, printed = run_loop(common, tmp_path)
    assert step == 2, printed
    assert any("SKIPPED the corrupt checkpoint" in line and "trainer_state.pt: truncated" in line for line in printed)
    assert "FALLING BACK to the previous complete checkpoint" in capfd.readouterr().err
