"""The Accelerate path: prepare + accumulate + clip at tp=2 x dp=2 equals one double batch on one process, and an
``accelerate launch`` smoke run of examples/train_clm.py (2 CPU processes) trains, saves and reloads."""
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
from oslo_models import training
from tests.helpers.dist import run_distributed
from tests.helpers.models import save_tiny_gpt2
from tests.training.test_zero_checkpoint import assert_matches_reference, make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _accumulate_worker(path):
    from accelerate import Accelerator

    gen = torch.Generator().manual_seed(5)
    steps = [torch.randint(1, 101, (8, 8), generator=gen) for _ in range(3)]  # global batch 8 = 2 dp x 2 micro x 2
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    ref_opt = make_optimizer(reference.parameters())
    for ids in steps:  # one double batch per step
        reference(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step(), ref_opt.zero_grad()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=2),
                                                    progress=False).train()
    ctx = model.parallel_context
    # A plain DataLoader: prepare must split it over dp (2 ways), not over the world (4 ways).
    micro = [m for ids in steps for m in ids.chunk(4)]  # micro-batches in order: step-major, then dp, then accum
    order = [m for s in range(3) for a in range(2) for d in range(2) for m in [micro[4 * s + 2 * d + a]]]
    loader = torch.utils.data.DataLoader(torch.cat(order), batch_size=2, shuffle=False)
    model, opt, loader = training.prepare(accelerator, model, make_optimizer(model.parameters()), loader)
    batches = list(loader)
    assert len(batches) == 6
    for batch in batches:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch, labels=batch).loss)
            if accelerator.sync_gradients:
                training.clip_grad_norm_(model, 0.5, accelerator=accelerator)
            opt.step(), opt.zero_grad()
    assert ctx.dp_size == 2
    assert_matches_reference(model, dict(reference.named_parameters()), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


def test_accumulation_with_accelerate_equals_double_batch(checkpoint):
    run_distributed(_accumulate_worker, 4, checkpoint)


def test_prepare_rejects_mismatched_world(checkpoint):
    from accelerate import Accelerator

    model = om.AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    with pytest.raises(ValueError, match="oslo_models model"):
        training.prepare(Accelerator(cpu=True), torch.nn.Linear(2, 2))
    del model


def test_accelerate_launch_train_clm_smoke(tmp_path):
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    out = tmp_path / "out"
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", os.path.join(ROOT, "examples", "train_clm.py"), "--tp", "2", "--steps", "12",
           "--seq-len", "32", "--n-embd", "64", "--grad-accum", "2", "--output", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "plain transformers sample" in result.stdout
    losses = json.loads((out / "loss.json").read_text())["losses"]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert (out / "loss.png").stat().st_size > 1000
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert plain.config.model_type == "gpt2"
    assert om.training.find_checkpoint(out / "checkpoint") == str(out / "checkpoint" / "step-00000012")


def test_torchrun_train_clm_pipeline_resumes(tmp_path):
    """examples/train_clm.py at pp=2 (1F1B, 2 microbatches) under torchrun: trains through model.train_step, stops
    checkpointed at step 4, resumes to step 6 with the loss history of an uninterrupted run, and exports a plain
    Hub folder (same logits in transformers and oslo_models)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")

    def run(out, *extra):
        cmd = [torchrun, "--nproc_per_node", "2", os.path.join(ROOT, "examples", "train_clm.py"), "--pp", "2",
               "--microbatches", "2", "--seq-len", "32", "--n-embd", "64", "--batch-size", "4", "--steps", "6",
               "--output", str(out), *extra]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout, json.loads((out / "loss.json").read_text())["losses"]

    _, uninterrupted = run(tmp_path / "whole")
    out = tmp_path / "out"
    _, first = run(out, "--stop-at", "4")
    stdout, resumed = run(out, "--resume")
    assert "resumed at step 4" in stdout
    assert len(first) == 4 and len(resumed) == 6 and resumed[:4] == first
    assert resumed == pytest.approx(uninterrupted, abs=1e-5)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    oslo = om.AutoModelForCausalLM.from_pretrained(str(out / "model"), progress=False).eval()
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(oslo(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-4)
