"""Gradient clipping off the default path, and what tells ZeRO-2 from ZeRO-3.

``grad_norm`` with ``norm_type=inf`` (a max, not a sum, over tp shards, pp stages and ZeRO shards) and with p=3
equals torch's total norm of the single-process model, and ``clip_grad_norm_(..., inf)`` its clipped gradients, at
tp=2 x dp=2 under ZeRO-1 (DDP), ZeRO-2 and ZeRO-3 (FSDP2: gradients split over dp too) and at pp=2 x tp=2. One
column-parallel gradient is scaled up first, so its largest element, which decides the inf-norm, lives on a single
tp rank, a single dp shard and a single pipeline stage: a missing or summing reduction on any axis changes it.

ZeRO-2 and ZeRO-3 give the same numbers by design; the difference is structural: after the forward, ZeRO-3 has
resharded every block's parameters (DTensor shards again, memory freed), ZeRO-2 keeps them unsharded until the
backward. The root (embeddings, final norm, tied head) stays unsharded after the forward in both.
"""
from __future__ import annotations

import math

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models import training
from tests.helpers.dist import run_distributed
from tests.helpers.models import expected_shard, save_tiny_gpt2

BIG = "transformer.h.0.mlp.c_fc.weight"  # column-parallel: its max element is on one tp rank
NORMS = (math.inf, 3.0)
MAX_NORM = 0.05


def _batch():
    return torch.randint(1, 101, (4, 8), generator=torch.Generator().manual_seed(3))


def _reference(path):
    """Total gradient norm per norm type, and the gradients after clipping with the inf-norm (single process)."""
    model = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    ids = _batch()
    model(ids, labels=ids).loss.backward()
    params = dict(model.named_parameters(remove_duplicate=False))
    params[BIG].grad.mul_(1000.0)
    norms = {p: torch.nn.utils.get_total_norm([g.grad for g in model.parameters()], p) for p in NORMS}
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, math.inf)
    return norms, {name: p.grad.clone() for name, p in params.items()}


def _local_grad(param):
    return param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad


def _check(model, expected, what):
    """The model's norms and inf-clipped gradients equal the reference's (``expected = _reference(...)``)."""
    inner = training.unwrap_model(model)
    norms, grads = expected
    for norm_type in NORMS:
        torch.testing.assert_close(training.grad_norm(model, norm_type), norms[norm_type], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} norm_type={norm_type}: {m}")
    torch.testing.assert_close(training.clip_grad_norm_(model, MAX_NORM, math.inf), norms[math.inf], rtol=1e-5,
                               atol=1e-6)
    for name, param in inner.named_parameters():
        torch.testing.assert_close(_local_grad(param), expected_shard(inner, name, grads[name]), rtol=1e-4,
                                   atol=1e-6, msg=lambda m, n=name: f"{what} clipped by inf-norm, {n}: {m}")


def _block_params_sharded(model) -> list[bool]:
    return [hasattr(p, "to_local") for block in model.transformer.h for p in block.parameters(recurse=True)]


def _root_params_sharded(model) -> list[bool]:
    blocks = {id(p) for block in model.transformer.h for p in block.parameters()}
    return [hasattr(p, "to_local") for p in model.parameters() if id(p) not in blocks]


def _worker(path):
    expected = _reference(path)
    for stage in (1, 2, 3):
        model = om.AutoModelForCausalLM.from_pretrained(
            path, parallel=om.ParallelConfig(tensor_parallel_size=2), progress=False).train()
        model, _ = training.shard_data_parallel(model, zero_stage=stage)
        inner = training.unwrap_model(model)
        ctx = inner.parallel_context
        ids = _batch().chunk(ctx.dp_size)[ctx.dp_rank]
        loss = model(ids, labels=ids).loss
        if stage >= 2:
            blocks = _block_params_sharded(model)
            assert all(blocks) if stage == 3 else not any(blocks), f"ZeRO-{stage}: block parameters after forward"
            assert not any(_root_params_sharded(model)), f"ZeRO-{stage}: root resharded after forward"
        loss.backward()
        if stage >= 2:  # after the backward both hold only their shards
            assert all(_block_params_sharded(model)) and all(_root_params_sharded(model))
        dict(inner.named_parameters())[BIG].grad.mul_(1000.0)
        _check(model, expected, f"tp=2 dp=2 ZeRO-{stage}")

    cfg = om.ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    ids = _batch()
    model.train_step({"input_ids": ids, "labels": ids})
    big = dict(model.named_parameters()).get(BIG)
    if big is not None:  # only the first stage holds layer 0
        big.grad.mul_(1000.0)
    _check(model, expected, "pp=2 tp=2")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


def test_clip_norms_inf_and_p_across_tp_pp_zero_and_zero3_reshards(checkpoint):
    run_distributed(_worker, 4, checkpoint)
