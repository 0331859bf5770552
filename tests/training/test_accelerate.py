"""The Accelerate path: prepare + accumulate + clip at tp=2 x dp=2 equals one double batch on one process; an
``accelerate launch --mixed_precision bf16`` run of examples/train_clm.py (2 CPU processes) honours the launcher,
survives a missing matplotlib and reports evaluation to a tracker; a pp=2 torchrun run resumes exactly and its
perplexity equals plain transformers'."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models import training
from tests.helpers import examples
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


def test_accelerate_launch_bf16_without_matplotlib_eval_and_trackers(tmp_path):
    """``accelerate launch --mixed_precision bf16`` (the launcher's flag, no script flag) trains in bf16, with
    matplotlib not importable (loss.json still written, the plot skipped), ``--eval-data`` evaluated every 6 steps
    and ``--report-to jsonl`` receiving every train and eval metric; the Hub folder loads in plain transformers."""
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    out = tmp_path / "out"
    launcher = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "bf16", "--dynamo_backend", "no"]
    result = examples.launch(launcher, "train_clm.py", "--tp", "2", "--steps", "12", "--seq-len", "32", "--n-embd",
                             "64", "--grad-accum", "2", "--output", str(out), "--eval-data",
                             examples.eval_file(tmp_path), "--eval-every", "6", "--eval-samples", "16",
                             "--report-to", "jsonl", env={"ACCELERATE_USE_CPU": "1"},
                             pythonpath=os.pathsep.join([examples.without_matplotlib(tmp_path), ROOT]))
    assert "plain transformers sample" in result.stdout and "mixed_precision=bf16" in result.stdout
    assert "loss.png skipped: matplotlib is not installed" in result.stdout and not (out / "loss.png").exists()
    report, metrics = examples.read_run(out)
    assert report["mixed_precision"] == "bf16" and report["args"]["mixed_precision"] is None
    losses = report["losses"]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert [m["step"] for m in metrics if "train/loss" in m] == list(range(1, 13))
    assert [m["train/loss"] for m in metrics if "train/loss" in m] == losses
    evals = [(m["step"], m["eval/perplexity"]) for m in metrics if "eval/loss" in m]
    assert [step for step, _ in evals] == [6, 12] and all(math.isfinite(p) and p > 1 for _, p in evals)
    assert [e["perplexity"] for e in report["eval"]] == [p for _, p in evals]
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert plain.config.model_type == "gpt2"
    assert om.training.find_checkpoint(out / "checkpoint") == str(out / "checkpoint" / "step-00000012")


def test_torchrun_train_clm_pipeline_resumes_and_evaluates(tmp_path):
    """examples/train_clm.py at pp=2 (1F1B, 2 microbatches) under torchrun: trains through model.train_step, stops
    checkpointed at step 4 (``--async-save``: steps 2 and 4 written in the background), resumes to step 6 with the
    loss history of an uninterrupted run, and exports a plain
    Hub folder (same logits in transformers and oslo_models). The uninterrupted run also evaluates ``--eval-data``
    through ``model.eval_step`` at steps 3 and 6 (without changing its training), and its final perplexity is
    what plain ``transformers`` computes on the saved checkpoint."""
    def run(out, *extra):
        result = examples.launch(examples.torchrun(2), "train_clm.py", "--pp", "2", "--microbatches", "2",
                                 *examples.TINY, "--steps", "6", "--output", str(out), *extra)
        return result.stdout, json.loads((out / "loss.json").read_text())

    whole = tmp_path / "whole"
    _, report = run(whole, "--eval-data", examples.eval_file(tmp_path), "--eval-every", "3", "--eval-samples", "24")
    uninterrupted = report["losses"]
    assert [e["step"] for e in report["eval"]] == [3, 6] and report["eval"][-1]["samples"] == 24
    plain = transformers.AutoModelForCausalLM.from_pretrained(whole / "model")
    expected = examples.plain_eval_loss(plain, str(whole / "eval_corpus"), 32, om.data.CausalLMCollator(), 4, 24)
    assert report["eval"][-1]["loss"] == pytest.approx(expected, abs=1e-5)
    assert report["eval"][-1]["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)

    out = tmp_path / "out"
    _, first = run(out, "--stop-at", "4", "--async-save", "--save-every", "2")  # checkpoints written in the background
    stdout, resumed = run(out, "--resume", "--async-save")
    first, resumed = first["losses"], resumed["losses"]
    assert "resumed at step 4" in stdout
    assert len(first) == 4 and len(resumed) == 6 and resumed[:4] == first
    assert resumed == pytest.approx(uninterrupted, abs=1e-5)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    oslo = om.AutoModelForCausalLM.from_pretrained(str(out / "model"), progress=False).eval()
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(oslo(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode,reason", [("FSDP", "FSDP plugin"), ("DEEPSPEED", "DeepSpeed plugin"),
                                         ("MEGATRON_LM", "Megatron-LM plugin")])
def test_prepare_refuses_accelerate_modes_it_does_not_drive(mode, reason):
    # An Accelerator launched with one of these plugins reports the mode; prepare refuses it before wrapping anything
    # (a real plugin needs its GPU stack: the check reads only ``distributed_type``). MULTI_CPU/NO pass.
    from accelerate.utils import DistributedType

    from oslo_models.training.prepare import check_accelerate_mode

    class Launched:
        distributed_type = DistributedType[mode]

    with pytest.raises(ValueError, match=reason):
        check_accelerate_mode(Launched())
    Launched.distributed_type = DistributedType.MULTI_CPU
    check_accelerate_mode(Launched())
