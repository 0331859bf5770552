"""Per-block plans (``ParallelConfig.block_plan``): the engine (``training/per_block.py``) trains a mixed plan with
single-process parity, bad plans are refused before any collective, and the search (``planner/blocks.py``) equals
brute force.

Parity: a tiny Llama (4 blocks, untied, biases) on 2 gloo ranks, plan ``S Rc s R`` (block 0 sharded and resharded
after forward, block 1 replicated and checkpointed, block 2 sharded and kept gathered, block 3 replicated), against
single-process ``transformers`` (fp32, 1e-5): loss, logits and every gradient of 3 AdamW steps, the clipped global
norm (replicated blocks' gradients counted once), the parameters after each step.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import oslo_models as om
from oslo_models import training
from oslo_models.planner import Hardware, ModelFacts, SearchSpace
from oslo_models.planner.blocks import BLOCK_OPTIONS, best_plan, block_costs, brute_force_plan, evaluate_plan
from oslo_models.planner.search import search
from tests.helpers.decoders import VOCAB, hf_class, save_tiny, tiny_config
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


# a slow link: replicating, keeping gathered, resharding and checkpointing each trade memory for time
SLOW = Hardware(5e9, 2e7, 5e-5, 2e7, 5e-5, 8)


def _costs(layers: int = 3, **kw):
    facts = ModelFacts(om.LlamaForCausalLM, tiny_config("llama", num_hidden_layers=layers))
    return block_costs(facts, 2, SLOW, global_batch=8, seq_len=64, micro_batch=2, **kw)


def _key(costs, plan):
    memory, time_ = evaluate_plan(costs, plan)
    return time_.total, memory.total


def test_block_search_equals_brute_force():
    costs = _costs()
    uniform = sorted(evaluate_plan(costs, (option,) * costs.blocks)[0].total for option in BLOCK_OPTIONS)
    assert len(set(np.round(costs.time[0], 12))) > 1  # the options really differ in time here
    mixed = 0
    rng = np.random.default_rng(0)
    for trial in range(3):  # the model's blocks, then blocks made unequal (random factors on every cost)
        if trial:
            costs.memory *= rng.uniform(0.5, 1.5, costs.memory.shape)
            costs.time *= rng.uniform(0.5, 1.5, costs.time.shape)
        for cap in np.linspace(uniform[0] * 0.9, uniform[-1] * 1.1, 12):
            fast, slow = best_plan(costs, cap), brute_force_plan(costs, cap)
            assert (fast is None) == (slow is None), cap
            if fast is not None:
                assert _key(costs, fast) == pytest.approx(_key(costs, slow), rel=1e-12), (cap, fast, slow)
                assert evaluate_plan(costs, fast)[0].total <= cap
                mixed += len(set(fast)) > 1
    assert mixed  # some caps are met only by mixing choices


def test_hundred_blocks_at_1024_ranks_plan_fast():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=8,
                         num_hidden_layers=100, vocab_size=32000)
    facts = ModelFacts(om.LlamaForCausalLM, config)
    start = time.perf_counter()
    costs = block_costs(facts, 1024, Hardware(400e12, 50e9, 5e-6, 5e9, 1e-5, 8), tensor_parallel_size=8,
                        global_batch=1024, seq_len=4096, micro_batch=1, mixed_precision="bf16")
    assert costs.blocks == 100
    plans = [best_plan(costs, cap) for cap in (5e9, 20e9, 40e9, 80e9)]
    assert time.perf_counter() - start < 20 and all(plans)


def test_search_offers_per_block_plans_that_round_trip():
    facts = ModelFacts(om.LlamaForCausalLM, tiny_config("llama", num_hidden_layers=4))
    space = SearchSpace(checkpointing=(None,), zero_stages=(0, 3), per_block=True, context_parallel=False)
    result = search(facts, 2, memory_cap=3e6, global_batch=8, seq_len=64, hardware=SLOW, space=space, top=50)
    planned = [c for c in result.candidates if c.parallel_config.block_plan]
    assert planned and all("blocks " in c.describe() for c in planned)
    config = planned[0].parallel_config
    assert om.ParallelConfig.from_json(config.to_json()) == config and config.zero_stage == 3
