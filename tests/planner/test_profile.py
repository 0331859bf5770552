"""The profiled time model (``planner/profile.py`` and ``time.py``'s profiled path), one process: the estimate is
the profile's figures by hand, the search's ranking follows a profile, the overlap coefficient's effect by hand,
the real blocks built at tp's local widths (and the fallback where a config cannot express them), and the
``plan --profile`` CLI on a tiny config.

The overlap coefficient and the per-kind collective costs need a process group; they are measured by
``benchmarks/planner_ranking.py --profile`` (not in CI).
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

import oslo_models as om
from oslo_models.cli import main
from oslo_models.planner import Hardware, ModelFacts, Profiler, ProfileTable, SearchSpace
from oslo_models.planner.profile import _EXTRA, block_key, outside_key
from oslo_models.planner.search import search
from oslo_models.planner.time import all_gather, all_reduce, estimate_time
from tests.helpers.decoders import tiny_config

P = om.ParallelConfig


@pytest.fixture(scope="module")
def facts():
    return ModelFacts(om.LlamaForCausalLM, tiny_config("llama"))  # 2 layers


def test_profiled_estimate_by_hand(facts):
    """compute = microbatches x (layers x block + outside) + optimizer seconds per byte x the rank's bytes (ZeRO:
    its shard); the FLOP rate plays no part."""
    table = ProfileTable({block_key(1, 16, 4, None): 0.01, block_key(1, 16, 4, "full"): 0.013},
                         {outside_key(1, 16, 4): 0.004}, optimizer=1e-9)
    hw = replace(Hardware.default("cpu"), profile=table, overlap=0.0)
    kw = dict(global_batch=8, seq_len=16, micro_batch=4, num_microbatches=2, param_bytes=10**6)
    single = estimate_time(facts, P(), 1, hw, **kw)
    assert single.compute == pytest.approx(2 * (2 * 0.01 + 0.004) + 1e-3) and single.total == single.compute
    full = estimate_time(facts, P(activation_checkpointing="partitioned"), 1, hw, **kw)  # timed as "full"
    assert full.compute == pytest.approx(2 * (2 * 0.013 + 0.004) + 1e-3)
    zero1 = estimate_time(facts, P(data_parallel_size=2, zero_stage=1), 2, hw, **dict(kw, num_microbatches=1))
    assert zero1.compute == pytest.approx(2 * 0.01 + 0.004 + 1e-3 / 2)
    with pytest.raises(KeyError, match="tp2 s16 b4"):
        estimate_time(facts, P(tensor_parallel_size=2), 2, hw, **kw)


class Scaled(ProfileTable):
    """A fake profile: a block costs ``per_token[tp] x tokens``; the outside a tenth of a tp=1 block."""

    def __init__(self, per_token: dict):
        super().__init__()
        self.per_token = per_token

    def _measure(self, tp, seq, micro_batch, checkpointing):
        tokens = seq * micro_batch
        extra = {None: 1.0, "selective": 1.1}.get(checkpointing, 4 / 3)
        self.blocks[block_key(tp, seq, micro_batch, checkpointing)] = self.per_token[tp] * tokens * extra
        self.outsides[outside_key(tp, seq, micro_batch)] = self.per_token[1] * tokens / 10


@pytest.mark.parametrize("tp_per_token, best_tp", [(1e-6, 2), (1e-3, 1)])
def test_search_ranking_follows_the_profile(facts, tp_per_token, best_tp):
    """The same model, links and space; only the profiled block times differ: cheap tp blocks put tp first,
    expensive ones put it last."""
    hw = Hardware(1e12, 1e12, 1e-9, 1e12, 1e-9, 8, profile=Scaled({1: 1e-4, 2: tp_per_token}))
    space = SearchSpace(checkpointing=(None,), schedules=("1f1b",), sequence_parallel=(False,),
                        context_parallel=False, zero_stages=(0,), max_microbatches=4)
    result = search(facts, 2, memory_cap=1e12, global_batch=4, seq_len=16, hardware=hw, space=space, top=50)
    tps = [c.layout.parallel.get("tensor_parallel_size", 1) for c in result.candidates]
    assert tps[0] == best_tp and (tps[-1] != best_tp)
    assert result.hardware.profile is hw.profile and hw.profile.blocks  # the search asked the profile


def test_overlap_coefficient_by_hand(facts):
    """dp2 ZeRO-0, FLOP path: DDP's all-reduce (one bucket) hides behind ``overlap x`` the backward:
    exposed = ``max(0, all_reduce - overlap x backward)``; 0 -> all of it, 1 -> none here."""
    nbytes = 4 * 10**5
    base = Hardware(1e9, 1e9, 1e-4, 1e9, 1e-4, 8)
    kw = dict(global_batch=8, seq_len=16, micro_batch=4, num_microbatches=1, param_bytes=nbytes)
    once = all_reduce(nbytes, 2, (1e9, 1e-4))  # 2 x 1/2 x 4e5 / 1e9 + 2 x 1e-4 = 6e-4 s
    assert once == pytest.approx(6e-4)
    for overlap in (0.0, 0.5, 1.0):
        t = estimate_time(facts, P(data_parallel_size=2), 2, replace(base, overlap=overlap), **kw)
        backward = t.compute * 2 / 3
        assert t.communication["dp"] == pytest.approx(max(0.0, once - overlap * backward))
        if overlap == 0.0:
            assert t.communication["dp"] == pytest.approx(once) and backward > once
        if overlap == 1.0:
            assert t.communication["dp"] == 0.0


def test_profiler_times_the_block_at_local_widths():
    """Llama: the block built with heads / tp, kv heads / tp and intermediate / tp holds exactly what a tp rank
    holds (no fallback). GPT-2 (the head width derived from ``n_embd / n_head``): halving the heads would not halve
    the widths, so the check refuses it and the tp=1 block / tp stands in, said in ``notes``."""
    llama = Profiler(ModelFacts(om.LlamaForCausalLM, tiny_config("llama", num_hidden_layers=1)), repeats=1)
    assert llama.block(2, 8, 1) > 0 and llama.outside(2, 8, 1) >= 0 and llama.optimizer > 0
    assert not llama.notes
    before = dict(llama.blocks)
    llama.refine(1)  # timed again round-robin: the same shapes, each keeping its best
    assert set(llama.blocks) == set(before) and all(llama.blocks[k] > 0 for k in before)
    # combined on the raw runs, not on the derived differences: raw times made 10 * index (each shape's two runs
    # adjacent, one layer then 1 + _EXTRA), every block is then 10 / _EXTRA; doubled raw runs double it. Set, not
    # timed: on a loaded box the measured difference can be clamped at its floor, and a doubled floor stays the floor
    llama.combine(lambda times: [10.0 * i for i in range(len(times))])
    assert llama.block(2, 8, 1) == pytest.approx(10 / _EXTRA)
    llama.combine(lambda times: [2 * t for t in times])
    assert llama.block(2, 8, 1) == pytest.approx(20 / _EXTRA)
    gpt2_class = om.models.registry.family_record("gpt2").model_class("causal_lm")
    gpt2 = Profiler(ModelFacts(gpt2_class, tiny_config("gpt2", n_layer=1)), repeats=1)
    assert gpt2.block(2, 8, 1) > 0
    assert gpt2.notes and "cannot express tp=2" in gpt2.notes[0]


def test_plan_cli_profile(tmp_path, capsys):
    tiny_config("llama", num_hidden_layers=2).save_pretrained(tmp_path / "model")
    start = time.perf_counter()
    code = main(["plan", "--model", str(tmp_path / "model"), "--world-size", "2", "--memory-per-device", "1GB",
                 "--global-batch", "2", "--seq-len", "8", "--device", "cpu", "--profile", "--profile-repeats", "1",
                 "--top", "3"])
    printed = capsys.readouterr().out
    assert code == 0 and "profiled: " in printed and "block shapes" in printed
    assert time.perf_counter() - start < 20


def test_per_block_costs_use_the_profile(facts):
    """``--per-block`` candidates take their compute from the profile too (the same figures as ``estimate_time``):
    a replicated block's time is the profiled block's per microbatch, a checkpointed one the profiled "full" block's,
    the root the profiled embedding/head; with one rank there is no traffic to add."""
    from oslo_models.planner.blocks import BLOCK_OPTIONS, block_costs

    table = ProfileTable({block_key(1, 16, 2, None): 0.01, block_key(1, 16, 2, "full"): 0.013},
                         {outside_key(1, 16, 2): 0.006})
    hw = replace(Hardware.default("cpu"), profile=table, overlap=0.0)
    costs = block_costs(facts, 1, hw, global_batch=8, seq_len=16, micro_batch=2)  # 4 microbatches
    for j, choice in enumerate(BLOCK_OPTIONS):
        expected = 4 * (0.013 if choice.checkpoint else 0.01)
        assert costs.time[:, j] == pytest.approx([expected] * costs.blocks), choice
    assert costs.base_time.compute == pytest.approx(4 * 0.006)
    flops = block_costs(facts, 1, replace(hw, profile=None), global_batch=8, seq_len=16, micro_batch=2)
    assert flops.time[0, 0] != pytest.approx(costs.time[0, 0])  # the FLOP path is not what was used above


def test_timed_groups_replace_the_link_model(facts):
    """Where the profile holds a block timed with its process groups (``profile_parallel.py``), the estimate charges
    ``grouped - alone`` as the axis's communication instead of the link model's terms: tp per microbatch; DDP
    (ZeRO-0/1) once per step, FSDP2 (ZeRO-2/3) every microbatch; ZeRO-1's broadcasts stay modelled. A key the
    profile lacks falls back to the link model."""
    from oslo_models.planner.profile_parallel import parallel_key

    blocks = {block_key(1, 16, 2, None): 0.010, block_key(2, 16, 4, None): 0.006}
    outsides = {outside_key(1, 16, 2): 0.004, outside_key(2, 16, 4): 0.003}
    grouped = {parallel_key(2, False, 1, 16, 4, None): [0.008, 0.005],
               parallel_key(1, False, 1, 16, 2, None, (0, 2)): [0.0125, 0.0045],
               parallel_key(1, False, 1, 16, 2, None, (3, 2)): [0.015, 0.006]}
    table = ProfileTable(blocks, outsides, parallel=grouped)
    links = replace(Hardware.default("cpu"), overlap=0.0)
    kw = dict(global_batch=8, seq_len=16, num_microbatches=2, param_bytes=10**6)
    tp = estimate_time(facts, P(tensor_parallel_size=2), 2, replace(links, profile=table), micro_batch=4, **kw)
    assert tp.communication == {"tp": pytest.approx(2 * (2 * (0.008 - 0.006) + 0.005 - 0.003))}
    modelled = estimate_time(facts, P(tensor_parallel_size=2), 2, replace(links, profile=ProfileTable(
        blocks, outsides)), micro_batch=4, **kw)
    assert modelled.communication["tp"] != tp.communication["tp"] and modelled.compute == tp.compute
    dp = dict(data_parallel_size=2)
    ddp = estimate_time(facts, P(**dp), 2, replace(links, profile=table), micro_batch=2, **kw)
    assert ddp.communication == {"dp": pytest.approx(2 * (0.0125 - 0.010) + 0.0045 - 0.004)}  # once per step
    table.parallel[parallel_key(1, False, 1, 16, 2, None, (1, 2))] = [0.0125, 0.0045]  # no step timed
    zero1 = estimate_time(facts, P(**dp, zero_stage=1), 2, replace(links, profile=table), micro_batch=2, **kw)
    broadcast = all_gather(10**6, 2, links.link(2, "all_gather"))
    assert zero1.communication["dp"] == pytest.approx(ddp.communication["dp"] + broadcast)
    zero3 = estimate_time(facts, P(**dp, zero_stage=3), 2, replace(links, profile=table), micro_batch=2, **kw)
    assert zero3.communication == {"dp": pytest.approx(2 * (2 * (0.015 - 0.010) + 0.006 - 0.004))}
    zero2 = estimate_time(facts, P(**dp, zero_stage=2), 2, replace(links, profile=table), micro_batch=2, **kw)
    assert zero2.communication["dp"] != pytest.approx(zero3.communication["dp"])  # z2x2 not timed: link model
    # with the optimizer step timed too (4 figures): the step as timed, ZeRO-1's broadcasts inside it
    grouped[parallel_key(1, False, 1, 16, 2, None, (1, 2))] = [0.0125, 0.0045, 0.0007, 0.0002]
    zero1 = estimate_time(facts, P(**dp, zero_stage=1), 2, replace(links, profile=ProfileTable(
        blocks, outsides, optimizer=1e-9, parallel=grouped)), micro_batch=2, **kw)
    assert zero1.communication["dp"] == pytest.approx(ddp.communication["dp"])
    assert zero1.compute == pytest.approx(2 * (2 * 0.010 + 0.004) + 2 * 0.0007 + 0.0002)
