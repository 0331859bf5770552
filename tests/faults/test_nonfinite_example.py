"""A loss that turns NaN stops examples/train_clm.py on every rank together, before the optimizer step, with one
clear line, and the last good checkpoint stays the newest (no NaN weights saved, no Hub folder exported).

The NaN is real, not injected: ``--lr 1e30`` with a 2-step warm-up leaves step 1 alone (learning rate 0), makes the
weights ~1e29 at step 2, and step 3's forward overflows (tp=2 under torchrun, a checkpoint every step). That every
rank decides together when only some see a NaN, the per-rank check disagreeing (the negative control), and that
``save_checkpoint`` refuses non-finite weights on its own are checked in ``checkpoint_faults.py``.
"""
from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import oslo_models as om
from oslo_models import training
from tests.faults import launch
from tests.helpers import examples
from tests.helpers.models import tiny_gpt2_config


def test_nan_loss_stops_every_rank_and_keeps_the_last_good_checkpoint(corpus, forkserver, tmp_path):
    out = tmp_path / "out"
    command = launch.agent(2) + launch.script(
        "train_clm.py", "--tp", "2", "--data", corpus["data"], "--tokenizer", corpus["tokenizer"], "--output",
        str(out), *examples.TINY, "--steps", "6", "--save-every", "1", "--lr", "1e30", "--warmup", "2",
        "--report-to", "jsonl")
    (text,), _ = launch.run([command], launch.environment(tmp_path, forkserver), tmp_path,
                              expect_success=False)
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



def test_fp16_loss_scaling_skips_a_nonfinite_step_on_every_rank(monkeypatch, tmp_path):
    """Under fp16 loss scaling the examples' ``check_step`` has the scaler skip the step and training goes on (the
    weights stay, the scale is lowered), on every rank: also on one whose own gradients are finite while another
    rank's shard overflowed (tp, ZeRO-2/3), which only the global norm shows. In process, with a CPU ``GradScaler``
    as Accelerate's on a GPU; the other rank's overflow is the global norm made inf. Negative control: the same
    gradients stepped without the scaler write NaN weights."""
    monkeypatch.syspath_prepend(examples.EXAMPLES)
    import _common

    torch.manual_seed(0)
    model = om.AutoModelForCausalLM.from_config(tiny_gpt2_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    printed = []
    for clip in (1.0, 0.0):  # --max-grad-norm 1 (clip_grad_norm_ marks the step) and 0 (check_step marks it)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        accelerator = SimpleNamespace(scaler=scaler, print=printed.append,
                                      unscale_gradients=lambda optimizer=None, scaler=scaler: scaler.unscale_(opt))
        opt = optimizer
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(ids, labels=ids).loss).backward()  # finite here: the overflow is on "another rank"
        with monkeypatch.context() as patch:
            inf = lambda *args, **kwargs: torch.tensor(float("inf"))  # noqa: E731 - the global norm
            patch.setattr(training, "grad_norm", inf)
            patch.setattr(training.clip, "grad_norm", inf)
            _common.check_step(SimpleNamespace(max_grad_norm=clip), accelerator, model, torch.tensor(2.0), 5,
                               str(tmp_path / "checkpoint"))  # no raise: the scaler skips
        assert "grad norm on rank(s) [0]: fp16 loss scaling skips this step on every rank (scale 256 is lowered)" \
            in printed[-1], printed
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == 128.0, clip
        assert all(torch.equal(param, before[name]) for name, param in model.named_parameters()), clip
    for name in ("_common", "_data", "_report"):  # _common imports the others: leave none bound to it
        sys.modules.pop(name, None)
    for param in model.parameters():  # negative control: an overflowed step taken anyway
        param.grad.fill_(float("inf"))
    optimizer.step()
    assert not all(torch.isfinite(param).all() for param in model.parameters())
