"""A run stopped and resumed from a training checkpoint continues bit for bit, with dropout on.

GPT-2 with dropout 0.1 everywhere at tp=2 x dp=2 (ZeRO-1), fed by ``build_dataloader`` (shuffled, resumable):
4 steps uninterrupted; then 2 steps, ``save_checkpoint``, fresh objects under another seed, ``load_checkpoint``,
2 more steps. The last two losses must be *equal* to the uninterrupted ones, which needs every random stream
restored: torch's generator (replicated dropout: embeddings and residual stream), each rank's tensor-parallel stream
(attention probabilities of its heads) and the loader's position. Sequence parallelism stays off here: under SP
every GPT-2 dropout draws from the tensor-parallel stream, and the torch generator would go untested.

Negative controls run the resumed step with one stream set wrong (torch reseeded; the tensor-parallel stream of
another seed): the loss must change, so the equality above depends on both streams.
"""
from __future__ import annotations

import os

import pytest
import torch

import oslo_models as om
from oslo_models import training
from oslo_models.data import CausalLMCollator, build_dataloader
from oslo_models.parallel_layers.random import RNGTracker
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import save_tiny_gpt2

NUM_STEPS, SAVE_AT = 4, 2


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(1, 101, (24, 8), generator=torch.Generator().manual_seed(11))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def _build(path):
    cfg = om.ParallelConfig(tensor_parallel_size=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    model, opt = training.shard_data_parallel(model, opt, zero_stage=1)
    loader = build_dataloader(_Tokens(), batch_size=2, collator=CausalLMCollator(pad_token_id=0),
                              parallel_context=training.unwrap_model(model).parallel_context, seed=5)
    return model, opt, loader


def _steps(model, opt, batches, count):
    losses = []
    for _ in range(count):
        breadcrumb(f"training step {len(losses)}")
        loss = model(**next(batches)).loss
        loss.backward()
        training.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def _worker(path, ckpt):
    torch.manual_seed(0)
    model, opt, loader = _build(path)
    expected = _steps(model, opt, iter(loader), NUM_STEPS)
    assert len({round(float(x), 6) for x in expected}) == NUM_STEPS

    torch.manual_seed(0)
    model, opt, loader = _build(path)
    head = _steps(model, opt, iter(loader), SAVE_AT)
    assert all(torch.equal(a, b) for a, b in zip(head, expected))
    training.save_checkpoint(ckpt, model, opt, dataloader=loader, step=SAVE_AT)
    del model, opt, loader

    torch.manual_seed(1234)  # the fresh objects start elsewhere; everything must come from the checkpoint
    model, opt, loader = _build(path)
    info = training.load_checkpoint(ckpt, model, opt, dataloader=loader)
    assert info["step"] == SAVE_AT and info["same_layout"]
    resumed = _steps(model, opt, iter(loader), NUM_STEPS - SAVE_AT)
    for step, (got, want) in enumerate(zip(resumed, expected[SAVE_AT:]), SAVE_AT):
        assert torch.equal(got, want), f"step {step}: resumed loss {got.item()!r} != uninterrupted {want.item()!r}"

    context = training.unwrap_model(model).parallel_context
    wrong_streams = {
        "torch generator reseeded": lambda: torch.manual_seed(77),
        "tensor-parallel stream of another seed": lambda: context.rng.load_state_dict(RNGTracker(
            99, tp_rank=context.tp_rank, tp_size=context.tp_size).state_dict()),
    }
    for what, spoil in wrong_streams.items():
        training.load_checkpoint(ckpt, model, opt, dataloader=loader)
        spoil()
        loss = _steps(model, opt, iter(loader), 1)[0]
        assert not torch.equal(loss, expected[SAVE_AT]), f"the resumed loss does not depend on the {what}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def test_resume_with_dropout_is_bit_identical(checkpoint, tmp_path):
    run_distributed(_worker, 4, checkpoint, os.fspath(tmp_path / "ckpt"))
