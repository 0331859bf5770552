"""GPT-2 at every tensor-parallel layout equals plain ``transformers`` GPT-2: logits, loss, every gradient,
parameters after 3 AdamW steps; tp x dp data parallelism equals the single-process run on the global batch."""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.models import (
    assert_gpt2_data_parallel_steps_match,
    assert_grads_match,
    assert_params_match,
    padded_batch,
    save_tiny_gpt2,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


def _parity_worker(path: str, tp: int, sp: bool) -> None:
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    model = om.AutoModelForCausalLM.from_pretrained(
        path, parallel=om.ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp), progress=False).train()
    assert model.parallel_context.tp_size == tp
    if tp > 1:  # the vocabulary (101) is padded up to a multiple of tp and each rank holds a slice
        assert model.lm_head.weight.shape[0] == -(-101 // tp)
    ids, mask, labels = padded_batch(101, batch=3, seq=8)
    # eps=1e-6: Adam turns float-noise gradients (the key bias gets ~0 by symmetry) into full-size steps of
    # random sign; a larger eps keeps the comparison about the parallel math, identically on both sides.
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    for step in range(3):
        expected = reference(ids, attention_mask=mask, labels=labels)
        got = model(ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
        expected.loss.backward()
        got.loss.backward()
        assert assert_grads_match(model, reference) == len(list(model.parameters()))
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
        assert_params_match(model, reference)
    # A length the TP size does not divide runs without sequence parallelism and still matches.
    odd = ids[:, :7]
    torch.testing.assert_close(model(odd).logits, reference(odd).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sp", [False, True])
def test_tp1_matches_transformers(checkpoint, sp):
    _parity_worker(checkpoint, 1, sp)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_tensor_parallel_matches_transformers(checkpoint, tp, sp):
    run_distributed(_parity_worker, tp, checkpoint, tp, sp)


def _tp_dp_worker(path: str) -> None:
    global_ids = torch.randint(1, 101, (4, 8), generator=torch.Generator().manual_seed(3))
    cfg = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    assert_gpt2_data_parallel_steps_match(path, cfg, global_ids, layout=(2, 2))


def test_tp2_dp2_matches_single_process(checkpoint):
    run_distributed(_tp_dp_worker, 4, checkpoint)
