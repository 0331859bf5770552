"""A loss that turns NaN stops examples/train_clm.py on every rank together, before the optimizer step, with one
clear line, and the last good checkpoint stays the newest (no NaN weights saved, no Hub folder exported).

The NaN is real, not injected: ``--lr 1e30`` with a 2-step warm-up leaves step 1 alone (learning rate 0), makes the
weights ~1e29 at step 2, and step 3's forward overflows (tp=2 under torchrun, a checkpoint every step). That every
rank decides together when only some see a NaN, the per-rank check disagreeing (the negative control), and that
``save_checkpoint`` refuses non-finite weights on its own are checked in ``checkpoint_faults.py``.
"""
from __future__ import annotations

import re

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from oslo_models import training
from tests.faults import launch
from tests.helpers import examples


def test_nan_loss_stops_every_rank_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    out = tmp_path / "out"
    command = launch.agent(2) + launch.script(
        "train_clm.py", "--tp", "2", "--data", corpus["data"], "--tokenizer", corpus["tokenizer"], "--output",
        str(out), *examples.TINY, "--steps", "6", "--save-every", "1", "--lr", "1e30", "--warmup", "2",
        "--report-to", "jsonl")
    (text,), _ = launch.run([command], launch.environment(tmp_path), tmp_path, expect_success=False)
    stops = [line for line in text.splitlines() if "train_clm.py: stopped:" in line]
    assert len(stops) == 1, text[-4000:]  # one line (rank 0), every rank exited with it (status 3)
    assert re.search(r"non-finite \(NaN/inf\) values at step 3: the loss on rank\(s\) \[0, 1\] and the grad norm on "
                     r"rank\(s\) \[0, 1\]; stopped before the optimizer step, nothing saved over the last good "
                     r"checkpoint \(.*step-00000002\)", stops[0]), stops[0]
    assert "exitcode  : 3" in text and "[rank1]: Traceback" not in text and "[rank0]: Traceback" not in text
    (logged,) = launch.attempts(out)
    assert sorted(logged) == [1, 2]
    assert training.find_checkpoint(out / "checkpoint") == str(out / "checkpoint" / "step-00000002")
    assert not (out / "checkpoint" / ".step-00000003.partial").exists() and not (out / "model").exists()
    dcp_to_torch_save(out / "checkpoint" / "step-00000002", tmp_path / "last_good.pt")
    state = torch.load(tmp_path / "last_good.pt", weights_only=False)
    weights = {key: value for key, value in state.items() if key.startswith("model/")}
    assert weights and all(torch.isfinite(value).all() for value in weights.values())
    assert max(value.abs().max().item() for value in weights.values()) > 1e20  # the blown-up step 2 is what it kept
