"""ZeRO stages 1/2/3/3+offload at tp=2 x dp=2 equal the single-process run; TP-correct clipping; overflow kept in
step across TP ranks; checkpoints resume bit-identically at the same layout and at other layouts.

Few spawned runs on purpose (2 shared CPU cores): each run checks several things.
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models import training
from tests.helpers.dist import run_distributed
from tests.helpers.models import expected_shard, save_tiny_gpt2

NUM_STEPS, GLOBAL_BATCH, SEQ = 5, 4, 8


def global_batches():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 101, (GLOBAL_BATCH, SEQ), generator=gen) for _ in range(NUM_STEPS)]


def make_optimizer(params):
    # eps=1e-6: see tests/models/test_gpt2_parity.py (Adam amplifies float noise of near-zero gradients).
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def reference_run(path):
    """Single-process transformers GPT-2 on the global batches: losses, grad norms, parameters after each step."""
    model = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    opt = make_optimizer(model.parameters())
    losses, norms, params = [], [], []
    for ids in global_batches():
        loss = model(ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        opt.step(), opt.zero_grad()
        losses.append(loss.detach())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, norms, params


def tp_local_params(model):
    inner = training.unwrap_model(model)
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in inner.named_parameters()}


def assert_matches_reference(model, reference_params, **tol):
    inner = training.unwrap_model(model)
    for name, value in tp_local_params(model).items():
        torch.testing.assert_close(value, expected_shard(inner, name, reference_params[name]),
                                   msg=lambda m, n=name: f"{n}: {m}", **tol)


def build(path, tp, zero_stage, cpu_offload=False):
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=tp),
                                                    progress=False).train()
    return training.shard_data_parallel(model, make_optimizer(model.parameters()), zero_stage=zero_stage,
                                        cpu_offload=cpu_offload)


def train_steps(model, opt, steps, clip=True):
    """Train on the given global-step indices; return the dp-mean losses and the grad norms."""
    ctx = training.unwrap_model(model).parallel_context
    batches = global_batches()
    losses, norms = [], []
    for step in steps:
        local = batches[step].chunk(ctx.dp_size)[ctx.dp_rank]
        loss = model(local, labels=local).loss
        loss.backward()
        norms.append(training.clip_grad_norm_(model, 0.5) if clip else None)
        opt.step(), opt.zero_grad()
        mean = loss.detach().clone()
        if ctx.dp_group is not None:
            torch.distributed.all_reduce(mean, group=ctx.dp_group)
        losses.append(mean / ctx.dp_size)
    return losses, norms


def _zero_worker(path, ckpt_dir):
    ref_losses, ref_norms, ref_params = reference_run(path)
    tol = dict(rtol=1e-4, atol=1e-5)
    for stage, offload in [(1, False), (2, False), (3, False), (3, True)]:
        model, opt = build(path, 2, stage, offload)
        ctx = training.unwrap_model(model).parallel_context
        assert (ctx.tp_size, ctx.dp_size) == (2, 2)
        if stage == 1:
            assert isinstance(opt, torch.distributed.optim.ZeroRedundancyOptimizer)
        else:  # FSDP2: every parameter (a tp-local shard) is split again over dp
            from torch.distributed.tensor import DTensor

            assert all(isinstance(p, DTensor) for p in model.parameters())
        losses, norms = train_steps(model, opt, range(NUM_STEPS))
        for step in range(NUM_STEPS):
            torch.testing.assert_close(losses[step], ref_losses[step], **tol)
            torch.testing.assert_close(norms[step], ref_norms[step], **tol)  # clipping at tp=2 == single process
        assert_matches_reference(model, ref_params[-1], **tol)

        if stage in (1, 3) and not offload:  # stop after step 3, resume in fresh objects: steps 4-5 identical
            final = tp_local_params(model)
            model, opt = build(path, 2, stage)
            train_steps(model, opt, range(3))
            path_ckpt = os.path.join(ckpt_dir, f"zero{stage}")
            training.save_checkpoint(path_ckpt, model, opt, step=3, extra={"note": "x"})
            del model, opt
            torch.manual_seed(999)  # the RNG state must come from the checkpoint, not from here
            model, opt = build(path, 2, stage)
            info = training.load_checkpoint(path_ckpt, model, opt)
            assert info["step"] == 3 and info["same_layout"] and info["extra"] == {"note": "x"}
            resumed, _ = train_steps(model, opt, range(3, NUM_STEPS))
            for got, expected in zip(resumed, losses[3:]):
                assert torch.equal(got, expected), (stage, got, expected)
            for name, value in tp_local_params(model).items():
                assert torch.equal(value, final[name]), name

    # fp16 loss scaling: an inf in one TP rank's shard makes *every* rank skip the step.
    model, opt = build(path, 2, 0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    ids = global_batches()[0].chunk(2)[ctx.dp_rank]
    scaler.scale(model(ids, labels=ids).loss).backward()
    if ctx.rank == 0:
        training.unwrap_model(model).transformer.h[0].attn.c_attn.weight.grad[0, 0] = float("inf")
    before = tp_local_params(model)
    scaler.unscale_(opt)
    assert training.sync_overflow(scaler, ctx)
    scaler.step(opt), scaler.update()
    assert scaler.get_scale() == 2.0 ** 7
    for name, value in tp_local_params(model).items():
        assert torch.equal(value, before[name]), name


def _other_layout_worker(path, ckpt_dir):
    ref_losses = reference_run(path)[0]
    batches = global_batches()
    for tp, stage in [(4, 0), (1, 2)]:  # saved at tp=2 x dp=2 with ZeRO-3; world 4 here
        model, opt = build(path, tp, stage)
        info = training.load_checkpoint(os.path.join(ckpt_dir, "zero3"), model, opt)
        assert info["step"] == 3 and not info["same_layout"]
        losses, _ = train_steps(model, opt, [3])
        torch.testing.assert_close(losses[0], ref_losses[3], rtol=1e-5, atol=1e-6)
    del batches


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


def test_zero_stages_clip_and_resume(checkpoint, tmp_path):
    run_distributed(_zero_worker, 4, checkpoint, str(tmp_path))
    assert training.find_checkpoint(tmp_path / "zero3") == str(tmp_path / "zero3" / "step-00000003")
    assert sorted(os.listdir(tmp_path / "zero3")) == ["latest", "step-00000003"]  # no partial folder left
    run_distributed(_other_layout_worker, 4, checkpoint, str(tmp_path))


def test_load_rejects_incomplete_folder(tmp_path, checkpoint):
    model = om.AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    (tmp_path / "bad" / ".step-00000001.partial").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no complete .* only interrupted saves"):
        training.load_checkpoint(tmp_path / "bad", model)
    with pytest.raises(ValueError, match="cpu_offload needs zero_stage 2 or 3"):
        training.shard_data_parallel(model, zero_stage=1, cpu_offload=True)
