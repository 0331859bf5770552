"""Expert parallelism for ``transformers``' MoE blocks through their own ``base_model_ep_plan``: ep 2 inside dp, alone,
with tensor (and sequence) parallelism and with ZeRO-1, trains like single-process transformers.

One spawned group of 4 gloo processes, through ``training.prepare`` with a plain DataLoader of rows with unequal
label counts (the loss is the global batch's; no load-balancing loss):

- ep 2 inside dp 4 (two ep groups of 2, each expert held by the 2 ranks of its edp group), seven routers: dots1
  (DeepSeek's grouped sigmoid router, shared expert, a dense first layer) and minimax_m2 (sigmoid router with a
  score-correction bias) at ZeRO-3, hunyuan_v1_moe (softmax top-k, shared MLP) at ZeRO-0, glm4_moe (grouped sigmoid
  router, shared experts) and granitemoehybrid (softmax top-k in a Mamba-2 hybrid) at ZeRO-3, ernie4_5_moe (softmax
  router, top-k on bias-corrected scores) and lfm2_moe (sigmoid router with an expert bias in a short-convolution
  hybrid) at ZeRO-0; dots1 again at ZeRO-1 (each expert's optimizer state on one rank of its edp group);
- ep 2 x tp 2 (dp 2): glm4_moe at ZeRO-3 and ZeRO-1, ernie4_5_moe at ZeRO-0, glm4_moe with sequence parallelism
  at ZeRO-3 (the experts leave the tp plan; attention, shared experts and head stay split over tp);
- ep 2 x cp 2 (dp 2; ep carved out of dp x cp, each expert on the 2 ranks of its edp group): glm4_moe ring ZeRO-3,
  dots1 ring ZeRO-1, ernie4_5_moe all-to-all ZeRO-0 (the loader splits whole sequences into the cp chunks);
- each rank holds half of the experts, and the logged loss of each of 3 AdamW steps and every parameter after them
  equal single-process ``transformers`` (fp32, 1e-5);
- with the load-balancing loss on (``output_router_logits=True``, coefficient 0.5): ernie4_5_moe at ep 2 x tp 2
  ZeRO-3 and at tp 2 + SP x dp 2 ZeRO-3 (no ep), minimax_m2 at ep 2 in dp 4 ZeRO-0 equal ``transformers`` on each
  step's replicas (the global batch's token loss plus each replica's own router term, computed at every tp rank on
  the replica's whole batch);
- negative controls: with the expert units' gradient scale taken off (FSDP2's own mean over edp instead of the sum
  over edp divided by dp x cp) the first step's expert gradients are twice the reference's, at ep 2 in dp 4 (dots1,
  minimax_m2), at ep 2 x tp 2 and at ep 2 x cp 2 (glm4_moe); a ZeRO-1 optimizer whose expert owners broadcast over
  the whole dp group (as for the dense parameters) overwrites each rank's experts with another ep rank's (after one
  step the two ranks of an ep group hold the same tensor; with the edp group they hold different experts).
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.generic.expert_parallel import GradientScale, expert_units
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    _collate,
    assert_same_parameters,
    prepared_steps,
    reference_steps,
    sft_rows,
)

CASES = {"dots1": 3, "minimax_m2": 3, "hunyuan_v1_moe": 0, "glm4_moe": 3, "granitemoehybrid": 3, "ernie4_5_moe": 0,
         "lfm2_moe": 0}  # name: zero stage, at ep 2 inside dp 4
EP_DP4 = dict(data_parallel_size=4, expert_parallel_size=2)
EP_TP = dict(tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2)
EP_CP = dict(context_parallel_size=2, data_parallel_size=2, expert_parallel_size=2)  # ep carved out of dp x cp
LAYOUTS = [("dots1", EP_DP4, 1), ("glm4_moe", EP_TP, 3), ("glm4_moe", EP_TP, 1), ("ernie4_5_moe", EP_TP, 0),
           ("glm4_moe", {**EP_TP, "sequence_parallel": True}, 3), ("glm4_moe", EP_CP, 3), ("dots1", EP_CP, 1),
           ("ernie4_5_moe", {**EP_CP, "context_parallel_mode": "all_to_all"}, 0)]  # (name, layout, zero stage)
ROUTER_LAYOUTS = [("ernie4_5_moe", EP_TP, 3), ("ernie4_5_moe", dict(tensor_parallel_size=2, sequence_parallel=True,
                                                                  data_parallel_size=2), 3),
                  ("minimax_m2", EP_DP4, 0)]
NEGATIVE = [("dots1", EP_DP4), ("minimax_m2", EP_DP4), ("glm4_moe", EP_TP), ("glm4_moe", EP_CP)]
BATCH, EXPERTS = 4, 4


def _first_gradients(model, rows, scaled: bool) -> dict:
    """ZeRO-3 and one backward of the first step's rows (each rank those ``training.prepare``'s loader would give
    it, over the global batch's share); ``scaled=False`` takes the expert units' gradient scale off (FSDP2's own mean
    over edp: the negative control). Returns the experts' whole gradients. (A constant factor on a gradient hardly
    moves AdamW's step, so the control compares gradients.)"""
    from oslo_models import training

    context = model.parallel_context
    model, _ = training.shard_data_parallel(model, None, zero_stage=3)
    if not scaled:
        for unit in expert_units(model):
            for key, hook in list(unit._forward_pre_hooks.items()):
                if isinstance(hook, GradientScale):
                    del unit._forward_pre_hooks[key]
    batch = _collate(rows[context.dp_rank * BATCH:(context.dp_rank + 1) * BATCH])
    if context.cp_size > 1:  # this rank's chunks, the targets shifted on the whole sequence first
        from oslo_models.data import ContextParallelSplitter

        batch = ContextParallelSplitter(context, shift_labels=True)(batch)
    local = training.count_label_tokens([batch], shifts_labels=True)
    model(**batch, num_items_in_batch=training.global_share(local, context)).loss.backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if ".experts." in n}


def _load(path, layout):
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**layout)).train()
    units = expert_units(model)
    assert units and all(unit.gate_up_proj.to_local().shape[0] == EXPERTS // 2 for unit in units)
    return model


def _reference_class(model):
    import transformers

    return type(transformers.AutoModelForCausalLM.from_config(model.config))


def _train(paths, name, layout, stage, rows):
    breadcrumb(f"{name} {layout} zero {stage}")
    model = _load(paths[name], layout)
    dp = model.parallel_context.dp_size
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=stage)
    reference, expected = reference_steps(_reference_class(model).from_pretrained(paths[name]).train(), rows,
                                          BATCH * dp)
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{name} {layout} zero {stage} logged losses: {m}")
    assert_same_parameters(model, reference)


def _train_with_router_loss(path, layout, stage, rows):
    import transformers

    from tests.generic.test_generic_context_parallel import ROUTER, _replica_reference_steps

    breadcrumb(f"{path} {layout} zero {stage} with the router loss")
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**layout), **ROUTER).train()
    dp = model.parallel_context.dp_size
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=stage)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, **ROUTER).train()
    reference, expected = _replica_reference_steps(reference, rows, dp)
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{path} {layout} router loss: {m}")
    assert_same_parameters(model, reference)


def _worker(paths, negative: bool):
    rows = sft_rows(101, 48)
    if not negative:
        for name, stage in CASES.items():
            _train(paths, name, EP_DP4, stage, rows)
        for name, layout, stage in LAYOUTS:
            _train(paths, name, layout, stage, rows)
        for name, layout, stage in ROUTER_LAYOUTS:
            _train_with_router_loss(paths[name], layout, stage, rows)
        return
    for name, layout in NEGATIVE:  # the first step's expert gradients: right with the scale, off without it
        breadcrumb(f"negative {name} {layout}")
        model = _load(paths[name], layout)
        dp = model.parallel_context.dp_size
        reference = _reference_class(model).from_pretrained(paths[name]).train()
        reference(**_collate(rows[:BATCH * dp])).loss.backward()
        expected = {n: p.grad for n, p in reference.named_parameters() if ".experts." in n}
        for n, grad in _first_gradients(model, rows, scaled=True).items():
            torch.testing.assert_close(grad, expected[n], atol=1e-6, rtol=1e-4)
        unscaled = _first_gradients(_load(paths[name], layout), rows, scaled=False)
        ratio = [float(grad.norm() / expected[n].norm()) for n, grad in unscaled.items()]
        assert all(abs(r - 2.0) < 1e-3 for r in ratio), ratio  # dp x cp / edp = 2: twice the gradient
    breadcrumb("negative: ZeRO-1 broadcasting experts over dp")
    for group in ("edp", "dp"):
        assert _zero1_experts_differ_over_ep(_load(paths["dots1"], EP_DP4), rows, group) == (group == "edp")


def _zero1_experts_differ_over_ep(model, rows, group: str) -> bool:
    """One ZeRO-1 step with the experts' optimizer-state owners broadcasting over ``group`` ("edp": the library's
    choice; "dp": as the dense parameters, the negative control); whether the two ranks of an ep group still hold
    different experts afterwards."""
    import torch.distributed as dist

    from oslo_models import training
    from oslo_models.training.dtensor_data_parallel import ShardedStateOptimizer, _expert_group

    context = model.parallel_context
    model, _ = training.shard_data_parallel(model, None, zero_stage=0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expert_group = _expert_group(model, context) if group == "edp" else context.dp_group
    optimizer = ShardedStateOptimizer(inner, context, {"lr": 1e-2}, expert_group=expert_group)
    batch = _collate(rows[context.dp_rank * BATCH:(context.dp_rank + 1) * BATCH])
    local = training.count_label_tokens([batch], shifts_labels=True)
    model(**batch, num_items_in_batch=training.global_share(local, context)).loss.backward()
    optimizer.step()
    expert = next(p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")).to_local().detach()
    peers = [torch.zeros_like(expert) for _ in range(context.ep_size)]
    dist.all_gather(peers, expert.contiguous(), group=context.ep_group)
    return not torch.equal(peers[0], peers[1])


@pytest.mark.slow
def test_generic_expert_parallel(tmp_path):
    paths = save(tmp_path / "models", CASES)
    run_distributed(_worker, 4, paths, False, timeout=900)
    run_distributed(_worker, 4, paths, True, timeout=900)
