"""Pipeline parallelism with Accelerate's bf16 mixed precision: ``om.training.prepare`` makes each stage run under
autocast inside the schedule (Accelerate's wrapper of ``model.forward`` never runs there), so pp=2 GPT-2 equals
``transformers`` under the same autocast: loss and every gradient over 2 AdamW steps to bf16 tolerance, the
first loss to fp32 rounding (the fp32 run misses it), every stage matmul in bf16, fp32 master weights. fp16 with pp:
``train_step(batch, scaler=...)`` scales each microbatch's loss inside the schedule, under the caller's fp16
autocast; 3 steps equal ``transformers`` with its own GradScaler (loss, unscaled gradients, parameters), the first
step overflowing on both (a 2**40 scale) and skipped on every rank (``sync_overflow``), the scales equal after.
Pure float16 *weights* with pp (no fp32 master copy to unscale into) are refused before the schedule runs."""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from accelerate import Accelerator
from oslo_models import training
from oslo_models.training.layout_rules import check_training_layout
from tests.helpers.dist import run_distributed
from tests.helpers.models import expected_shard, save_tiny_gpt2
from tests.helpers.pipeline import ADAMW

BF16 = dict(atol=2e-3, rtol=2e-2)
FP16 = dict(atol=2e-3, rtol=2e-3)


def _batch():
    ids = torch.randint(1, 101, (4, 16), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids}


def _reference_steps(path, autocast: bool):
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    losses, grads = [], []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = reference(**_batch()).loss
        loss.backward()
        losses.append(loss.detach().float())
        grads.append({n: p.grad.clone() for n, p in reference.named_parameters(remove_duplicate=False)})
        opt.step(), opt.zero_grad()
    return losses, grads


def _worker(path: str) -> None:
    bf16_losses, bf16_grads = _reference_steps(path, autocast=True)
    fp32_losses, _ = _reference_steps(path, autocast=False)
    # The setup tells bf16 from fp32: a stage that silently ran in fp32 would miss the step-0 loss below.
    assert (fp32_losses[0] - bf16_losses[0]).abs() > 1e-5
    cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=2)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")

    refused = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False)
    check_training_layout(refused.parallel_context.config, mixed_precision="fp16")  # what prepare runs: accepted
    with pytest.raises(NotImplementedError, match="pipelined model with float16 weights"):
        refused.half().train_step(_batch())  # before the schedule runs: no collective
    _fp16_steps_match(path, cfg)

    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    model, opt = training.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), **ADAMW))
    seen = set()
    for module in model.modules():
        if type(module).__name__.endswith("Linear"):  # this project's (column/row-parallel) linears
            module.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    for step in range(2):
        loss = model.train_step(_batch())
        torch.testing.assert_close(loss, bf16_losses[step], **BF16)
        # bf16 and fp32 runs differ by more than the tolerance: a stage running in fp32 would fail above.
        if step == 0:  # same bf16 matmuls as the reference: the loss agrees to fp32 rounding of the sum
            torch.testing.assert_close(loss, bf16_losses[0], atol=2e-6, rtol=0)
        for name, param in model.named_parameters():
            expected = expected_shard(model, name, bf16_grads[step][name])
            torch.testing.assert_close(param.grad, expected, **BF16, msg=lambda m, n=name: f"{n}: {m}")
        opt.step(), opt.zero_grad()
    assert seen == {torch.bfloat16}, seen  # every matmul of the stages ran under autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32


def _fp16_steps_match(path, cfg) -> None:
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    optimizers = [torch.optim.AdamW(m.parameters(), **ADAMW) for m in (reference, model)]
    # 2**40 overflows fp16 in the backward: step 0 is skipped, and the backoff brings the scale to 2**10 at once
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, backoff_factor=2.0 ** -30) for _ in range(2)]
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            expected = reference(**_batch()).loss
            loss = model.train_step(_batch(), scaler=scalers[1])
        scalers[0].scale(expected).backward()
        torch.testing.assert_close(loss, expected.detach().float(), **FP16)
        for scaler, optimizer in zip(scalers, optimizers):
            scaler.unscale_(optimizer)
        assert training.sync_overflow(scalers[1], model.parallel_context) == (step == 0)
        if step:
            grads = dict(reference.named_parameters(remove_duplicate=False))
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad, expected_shard(model, name, grads[name].grad), **FP16,
                                           msg=lambda m, n=name: f"step {step} {n}: {m}")
        for scaler, optimizer in zip(scalers, optimizers):
            scaler.step(optimizer), scaler.update(), optimizer.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** 10
    params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, expected_shard(model, name, params[name].detach()), atol=1e-3, rtol=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer=4)


def test_bf16_and_fp16_with_pipeline_match_transformers(checkpoint):
    run_distributed(_worker, 2, checkpoint, timeout=180)


def test_config_takes_zero23_with_pipeline():
    for stage in (1, 2, 3):  # ZeRO-2/3: an FSDP2 root per stage (tests/training/test_fsdp_compositions.py)
        assert om.ParallelConfig(pipeline_parallel_size=2, zero_stage=stage).zero_stage == stage
