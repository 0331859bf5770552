"""Pipeline x expert parallelism at ZeRO-1, 2 and 3 (issue 50): pp 2 x ep 2 inside dp 2 (4 gloo processes, one
spawned group), through ``training.prepare`` and ``model.train_step`` (1F1B, two microbatches per replica) with a
plain DataLoader of SFT rows whose label counts differ.

- ZeRO-1: the pipeline runner sums the experts' gradients over the expert-data-parallel ranks and divides by dp;
  the optimizer state of dense parameters is partitioned over dp, the experts' over edp (``split_optimizer``; the
  DTensor ``ShardedStateOptimizer`` on the generic path);
- ZeRO-2 (Mixtral, dots1) and ZeRO-3: each stage an FSDP2 root, the expert units their own FSDP2 units on the edp mesh
  (reduce-scatter = sum over edp / dp), the runner reducing nothing itself;

for native Mixtral, native Qwen2-MoE (a dense layer, a shared expert; ZeRO-1 and 3) and the generic path's dots1 (a
dense first layer, then MoE; ZeRO-1, 2 and 3): the logged loss of each of 3 AdamW
steps and every parameter after them equal single-process ``transformers`` (fp32, 1e-5). Negative controls: at
ZeRO-1 with the experts averaged over dp like dense weights (the runner's expert rule off) Mixtral trains away; at
ZeRO-3 with Mixtral's experts left inside their layer's unit, sharded and reduced over dp (the ranks holding *other*
experts) like dense weights (the model's plan naming no experts, so no expert unit on the edp mesh) it trains away.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.parallel_layers.plan import ParallelPlan
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import save_seeded
from tests.training.test_global_batch_loss import (
    assert_same_parameters,
    parameters_differ,
    prepared_steps,
    reference_steps,
    sft_rows,
)

BATCH = 4  # rows per replica and step
LAYOUT = dict(pipeline_parallel_size=2, num_microbatches=2, data_parallel_size=2, expert_parallel_size=2)
MIXTRAL = dict(vocab_size=101, hidden_size=32, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
               pad_token_id=0)
QWEN2_MOE = dict(MIXTRAL, num_hidden_layers=4, intermediate_size=40, moe_intermediate_size=16,
                 shared_expert_intermediate_size=24, num_experts=4, mlp_only_layers=[1], norm_topk_prob=False)
CASES = [("mixtral", 1), ("mixtral", 2), ("mixtral", 3), ("qwen2_moe", 1), ("qwen2_moe", 3), ("dots1", 1),
         ("dots1", 2), ("dots1", 3)]  # (model, ZeRO stage)


def train(path, zero_stage, rows, broken=None, layout=LAYOUT):
    """3 AdamW steps of ``path`` at ``layout`` (pipelined, experts over ep) through ``training.prepare`` and of
    ``transformers`` on the same global batches; ``broken`` the negative control: ``"runner"`` (the experts averaged
    over dp like dense weights) or ``"plan"`` (no expert units: the experts sharded and reduced over dp). Returns the
    trained model, the reference and both runs' logged losses."""
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**layout)).train()
    dp = model.parallel_context.dp_size
    if model.pipeline_layout.has_last:
        assert model._pipeline_runner()._expert_parameters(), "no experts split over ep on the last stage"
    if broken == "runner":  # the experts' gradients averaged over dp like dense weights
        model._pipeline_runner()._expert_parameters = dict
    elif broken == "plan":  # no expert units: the experts sharded and reduced over dp (ranks holding others)
        model.parallel_plan = ParallelPlan({})
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=zero_stage)
    if broken == "plan":  # the class's plan again: the comparison slices the reference's experts by it
        del model.parallel_plan
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    reference, expected = reference_steps(reference, rows, BATCH * dp)
    return model, reference, logged, expected


def check(paths, cases, controls, layout=LAYOUT):
    """Every ``(name, zero_stage[, layout])`` of ``cases`` equals ``transformers`` (losses and parameters, 1e-5);
    every ``(name, zero_stage, broken[, layout])`` of ``controls`` trains away from it."""
    rows = sft_rows(101, 48)
    for name, zero_stage, *own in cases:
        breadcrumb(f"{name} {own or layout} zero{zero_stage}")
        model, reference, logged, expected = train(paths[name], zero_stage, rows, layout=own[0] if own else layout)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} {own or layout} zero{zero_stage} logged losses: {m}")
        assert_same_parameters(model, reference)
        del model, reference
    for name, zero_stage, broken, *own in controls:
        breadcrumb(f"negative control {broken}: {name} {own or layout} zero{zero_stage}")
        model, reference, _, _ = train(paths[name], zero_stage, rows, broken=broken, layout=own[0] if own else layout)
        assert parameters_differ(model, reference), f"{broken}: the broken {name} matched transformers"
        del model, reference


def save_models(tmp_path, generic=("dots1",)) -> dict[str, str]:
    """Tiny checkpoints: native Mixtral and Qwen2-MoE, and the generic types ``generic``."""
    paths = save(tmp_path / "generic", list(generic))
    configs = {"mixtral": lambda: transformers.MixtralConfig(**MIXTRAL),
               "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**QWEN2_MOE)}
    paths.update(save_seeded(tmp_path, configs, {"mixtral": transformers.MixtralForCausalLM,
                                                 "qwen2_moe": transformers.Qwen2MoeForCausalLM}))
    return paths


def _worker(paths):
    check(paths, CASES, (("mixtral", 1, "runner"), ("mixtral", 3, "plan")))


@pytest.mark.slow
def test_pipeline_expert_parallel_zero(tmp_path):
    run_distributed(_worker, 4, save_models(tmp_path), timeout=600)
