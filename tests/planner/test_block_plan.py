"""Per-block plans (``ParallelConfig.block_plan``): the engine (``training/per_block.py``) trains a mixed plan with
single-process parity, bad plans are refused before any collective, and the search (``planner/blocks.py``) equals
brute force.

Parity: a tiny Llama (4 blocks, untied, biases) on 2 gloo ranks, plan ``S Rc s R`` (block 0 sharded and resharded
after forward, block 1 replicated and checkpointed, block 2 sharded and kept gathered, block 3 replicated), against
single-process ``transformers`` (fp32, 1e-5): loss, logits and every gradient of 3 AdamW steps, the clipped global
norm (replicated blocks' gradients counted once), the parameters after each step.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models import training
from tests.helpers.decoders import VOCAB, hf_class, save_tiny
from tests.helpers.dist import run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.models import padded_batch

MIXED = [{"shard": True}, {"shard": False, "checkpoint": True}, {"shard": True, "reshard_after_forward": False},
         {"shard": False}]


def _mixed_plan_trains(path: str) -> None:
    config = om.ParallelConfig(data_parallel_size=2, zero_stage=3, block_plan=MIXED)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=config, progress=False).train()
    layers = model.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [False, True, False, False]
    # wrong lengths are refused before any collective (one rank alone raising would hang the other otherwise)
    short = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(
        data_parallel_size=2, zero_stage=3), progress=False)
    object.__setattr__(short.parallel_context.config, "block_plan", config.block_plan[:3])
    with pytest.raises(ValueError, match="block_plan has 3 entries but LlamaForCausalLM has 4 blocks"):
        training.shard_data_parallel(short, torch.optim.AdamW(short.parameters()))
    ids, mask, labels = padded_batch(VOCAB, batch=4, seq=16)
    model, _ = train_matches(model, hf_class("llama").from_pretrained(path).train(),
                             dict(input_ids=ids, attention_mask=mask, labels=labels), zero_stage=3, steps=3,
                             max_grad_norm=0.5)
    rows = layers[0].mlp.up_proj.weight.shape[0]
    for layer, choice in zip(layers, MIXED):  # sharded blocks hold half the rows at rest, replicated ones all
        local = layer.mlp.up_proj.weight.to_local().shape[0]
        assert local == (rows // 2 if choice["shard"] else rows), (choice, local)


def test_mixed_block_plan_trains_with_parity(tmp_path):
    path = save_tiny(tmp_path / "llama", "llama", num_hidden_layers=4)
    run_distributed(_mixed_plan_trains, 2, path, timeout=600)


def test_bad_block_plans_are_refused():
    with pytest.raises(ValueError, match=r"block_plan\[1\] has unknown key\(s\) \['sahrd'\]"):
        om.ParallelConfig(zero_stage=3, block_plan=[{}, {"sahrd": True}])
    with pytest.raises(ValueError, match=r"block_plan\[0\].checkpoint must be a bool"):
        om.ParallelConfig(zero_stage=3, block_plan=[{"checkpoint": "yes"}])
    with pytest.raises(ValueError, match="reshard_after_forward=True needs shard=True"):
        om.ParallelConfig(zero_stage=3, block_plan=[{"shard": False, "reshard_after_forward": True}])
    with pytest.raises(ValueError, match="needs zero_stage=3"):
        om.ParallelConfig(zero_stage=2, block_plan=[{}])
    with pytest.raises(ValueError, match="leave activation_checkpointing=None"):
        om.ParallelConfig(zero_stage=3, block_plan=[{}], activation_checkpointing="full")
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2 is not implemented"):
        om.ParallelConfig(zero_stage=3, block_plan=[{}], pipeline_parallel_size=2)
    config = om.ParallelConfig(zero_stage=3, block_plan=MIXED)
    assert om.ParallelConfig.from_json(config.to_json()) == config  # data: a JSON round trip


def test_block_checkpoint_count_is_checked(tmp_path):
    path = save_tiny(tmp_path / "llama", "llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="block_plan has 3 entries but LlamaForCausalLM has 2 checkpointable"):
        om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(
            zero_stage=3, block_plan=[{"checkpoint": True}] * 3), progress=False)
