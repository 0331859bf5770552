"""Activation checkpointing under tensor parallelism with dropout: the recomputed blocks replay this rank's
tensor-parallel dropout stream, so loss and every gradient equal the run without checkpointing (GPT-2 tp=2 + SP,
dropout 0.1 everywhere: attention probabilities of this rank's heads and sequence-parallel slices draw from it)."""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from tests.helpers.checkpointing import enable_checkpointing
from tests.helpers.dist import run_distributed
from tests.helpers.models import padded_batch, save_tiny_gpt2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer=2, resid_pdrop=0.1, embd_pdrop=0.1,
                          attn_pdrop=0.1)


def _loss_and_grads(model, ids, mask, labels, rng_states):
    torch.set_rng_state(rng_states[0])
    model.parallel_context.rng.load_state_dict(rng_states[1])
    model.zero_grad(set_to_none=True)
    loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _worker(path: str) -> None:
    ids, mask, labels = padded_batch(101, batch=3, seq=8)
    cfg = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    states = (torch.get_rng_state(), model.parallel_context.rng.state_dict())
    plain_loss, plain_grads = _loss_and_grads(model, ids, mask, labels, states)
    # Dropout is really on: another draw of the masks gives another loss.
    other_loss = model(ids, attention_mask=mask, labels=labels).loss.detach()
    assert not torch.allclose(other_loss, plain_loss)
    enable_checkpointing(model)
    assert all(block.gradient_checkpointing for block in model.transformer.h)
    loss, grads = _loss_and_grads(model, ids, mask, labels, states)
    torch.testing.assert_close(loss, plain_loss, atol=0, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_checkpointed_blocks_replay_tensor_parallel_dropout(checkpoint):
    run_distributed(_worker, 2, checkpoint)
