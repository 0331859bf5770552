"""examples/train_vlm.py under torchrun at 2 processes (tp 2, vision frozen, samples packed per row): it trains the
tiny LLaVA on the built-in shapes-caption set (loss down), evaluates held-out samples, and saves a Hub folder that
plain ``transformers`` opens: the vision tower and projector in it are the initial ones (frozen) while the language
model moved, and plain ``transformers`` + the saved processor caption a held-out image with the tokens the script
printed. At dp 2 ZeRO-3 it evaluates mid-run and checkpoints. At pp 2 and at cp 2 it logs the one-process run's
losses and evaluation and saves its parameters. Pipeline parallelism with context parallelism is refused with one
clear error (exit status 2) before anything starts."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from oslo_models.image_text import vision_parameter_names
from oslo_models.image_text.demo import ShapesCaptions, llava_processor, tiny_llava_config
from tests.helpers import examples


@pytest.mark.slow
def test_train_vlm_under_torchrun(tmp_path):
    out = tmp_path / "run"
    result = examples.launch(examples.torchrun(2), "train_vlm.py", "--tp", "2", "--freeze-vision", "--pack",
                             "--seq-len", "64", "--steps", "6", "--batch-size", "4", "--n-embd", "64",
                             "--eval-every", "3", "--eval-samples", "8", "--output", str(out), timeout=600)
    report = json.loads((out / "loss.json").read_text())
    losses = report["losses"]
    assert len(losses) == 6 and all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]
    assert [e["step"] for e in report["eval"]] == [3, 6]
    model_dir = out / "model"
    plain = transformers.AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    torch.manual_seed(0)  # the script's seed: the initial weights it drew
    initial = transformers.LlavaForConditionalGeneration._from_config(
        tiny_llava_config(llava_processor().tokenizer, hidden=64, layers=2))
    saved, start = plain.state_dict(), initial.state_dict()
    frozen = vision_parameter_names(plain)
    assert frozen and all(torch.equal(saved[name], start[name]) for name in frozen)
    assert not torch.equal(saved["lm_head.weight"], start["lm_head.weight"])  # the language model trained
    sample = ShapesCaptions(1, offset=10 ** 6)[0]
    inputs = processor(images=[sample["image"]], text=[sample["prompt"]], return_tensors="pt")
    tokens = plain.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
    caption = processor.tokenizer.decode(tokens[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert (out / "caption.txt").read_text().strip() == caption.strip()
    assert "plain transformers caption" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["3", "0"])
def test_train_vlm_at_dp2_evaluates_and_checkpoints(tmp_path, zero):
    """dp 2 with the vision tower trained, an evaluation mid-run and at the end, then the resumable checkpoint and
    the Hub folder. ZeRO-3: before save_checkpoint resharded FSDP2 itself, the save after a no-grad evaluation crashed
    a rank with SIGSEGV. ZeRO-0 (plain DDP): the example asks DDP to look for unused parameters (CLIP's last layer
    feeds nothing in LLaVA); without that DDP stopped at the second step."""
    out = tmp_path / "run"
    examples.launch(examples.torchrun(2), "train_vlm.py", "--zero", zero, "--steps", "3", "--batch-size", "2",
                    "--n-embd", "64", "--eval-every", "2", "--eval-samples", "4", "--output", str(out), timeout=600)
    report = json.loads((out / "loss.json").read_text())
    assert [e["step"] for e in report["eval"]] == [2, 3] and len(report["losses"]) == 3
    assert (out / "checkpoint").is_dir()
    transformers.AutoModelForImageTextToText.from_pretrained(out / "model")


def _run(tmp_path, name, nproc, *flags):
    out = tmp_path / name
    examples.launch(examples.torchrun(nproc), "train_vlm.py", *flags, "--steps", "3", "--batch-size", "2",
                    "--n-embd", "64", "--eval-every", "3", "--eval-samples", "4", "--output", str(out), timeout=600)
    return json.loads((out / "loss.json").read_text()), out


@pytest.mark.slow
def test_train_vlm_pipeline_and_context_parallel(tmp_path):
    """``--pp 2`` (vision tower on the first stage, ``train_step`` / ``eval_step``) and ``--cp 2`` (the merged
    sequence split after the merge; rows padded to a length the ring layout splits) under torchrun at 2 processes:
    each step's logged loss and the evaluation equal the same script in one process (1e-5), and each saves a Hub
    folder plain ``transformers`` loads whose parameters equal the one-process run's (1e-5)."""
    single, single_out = _run(tmp_path, "single", 1)
    expected = transformers.AutoModelForImageTextToText.from_pretrained(single_out / "model").state_dict()
    for name, flags in (("pp", ("--pp", "2")), ("cp", ("--cp", "2"))):
        report, out = _run(tmp_path, name, 2, *flags)
        torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(single["losses"]), atol=1e-5,
                                   rtol=1e-5, msg=lambda m, n=name: f"{n} losses: {m}")
        assert report["eval"][-1]["step"] == 3
        torch.testing.assert_close(report["eval"][-1]["loss"], single["eval"][-1]["loss"], atol=1e-5, rtol=1e-5)
        saved = transformers.AutoModelForImageTextToText.from_pretrained(out / "model").state_dict()
        assert set(saved) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(saved[key], value, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{name} {k}: {m}")


def test_train_vlm_refuses_pipeline_with_context_parallel(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=examples.ROOT, WORLD_SIZE="4")
    import subprocess
    import sys

    result = subprocess.run([sys.executable, os.path.join(examples.EXAMPLES, "train_vlm.py"), "--pp", "2", "--cp",
                             "2", "--output", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "pipeline_parallel_size=2 with context_parallel_size=2" in result.stdout + result.stderr
