"""Smoke runs of examples/train_mlm.py (BERT masked LM) and examples/train_seq2seq.py (T5 span corruption) at tp=2
and at pp=2 (pipelined train_step) over 2 CPU processes: they train, write a loss curve, and save a Hub folder that plain ``transformers`` loads and
that gives the logits the ``oslo_models`` model loaded from the same folder gives."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers

import oslo_models as om

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2", "--microbatches", "2")], ids=["tp2", "pp2"])
@pytest.mark.parametrize("script, plain_cls, oslo_cls", [
    ("train_mlm.py", transformers.BertForMaskedLM, om.AutoModelForMaskedLM),
    ("train_seq2seq.py", transformers.T5ForConditionalGeneration, om.AutoModelForSeq2SeqLM),
])
def test_example_smoke(tmp_path, script, plain_cls, oslo_cls, layout):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = tmp_path / "out"
    cmd = [torchrun, "--nproc_per_node", "2", os.path.join(ROOT, "examples", script), *layout, "--steps", "4",
           "--seq-len", "32", "--n-embd", "64", "--batch-size", "4", "--output", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "plain transformers" in result.stdout
    losses = json.loads((out / "loss.json").read_text())["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert (out / "loss.png").stat().st_size > 1000

    model_dir = out / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    plain = plain_cls.from_pretrained(model_dir).eval()
    oslo = oslo_cls.from_pretrained(str(model_dir), progress=False).eval()
    ids = tokenizer("Shall I compare thee to a summer's day?", return_tensors="pt")["input_ids"]
    kwargs = {"input_ids": ids}
    if plain.config.is_encoder_decoder:
        kwargs["decoder_input_ids"] = torch.tensor([[plain.config.decoder_start_token_id, *ids[0, :5].tolist()]])
    with torch.no_grad():
        expected, got = plain(**kwargs).logits, oslo(**kwargs).logits
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
