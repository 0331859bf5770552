"""Expert parallelism for ``transformers``' MoE blocks through their own ``base_model_ep_plan``: ep 2 inside dp 4
trains like single-process transformers.

One spawned group of 4 gloo processes (``data_parallel_size=4, expert_parallel_size=2``: two ep groups of 2, each
expert held by the 2 ranks of its edp group), through ``training.prepare`` with a plain DataLoader of rows with unequal
label counts (the loss is the global batch's; no load-balancing loss):

- seven routers: dots1 (DeepSeek's grouped sigmoid router, shared expert, a dense first layer) and minimax_m2
  (sigmoid router with a score-correction bias) at ZeRO-3, hunyuan_v1_moe (softmax top-k, shared MLP) at ZeRO-0,
  glm4_moe (grouped sigmoid router, shared experts) and granitemoehybrid (softmax top-k in a Mamba-2 hybrid) at
  ZeRO-3, ernie4_5_moe (softmax router, top-k on bias-corrected scores) and lfm2_moe (sigmoid router with an expert
  bias in a short-convolution hybrid) at ZeRO-0: each rank holds half of the experts, and the logged loss of each of
  3 AdamW steps and every parameter after them equal single-process ``transformers`` (fp32, 1e-5);
- negative control: with the expert units' gradient scale taken off (FSDP2's own mean over edp instead of the sum
  over edp divided by dp) the experts train away from the reference;
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.generic.expert_parallel import GradientScale, expert_units
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import assert_same_parameters, prepared_steps, reference_steps, sft_rows

CASES = {"dots1": 3, "minimax_m2": 3, "hunyuan_v1_moe": 0, "glm4_moe": 3, "granitemoehybrid": 3, "ernie4_5_moe": 0,
         "lfm2_moe": 0}  # name: zero stage
NEGATIVE = ("dots1", "minimax_m2")
BATCH, EXPERTS = 4, 4


def _first_gradients(model, rows, scaled: bool) -> dict:
    """ZeRO-3 and one backward of the first step's rows (each rank those ``training.prepare``'s loader would give
    it, over the global batch's share); ``scaled=False`` takes the expert units' gradient scale off (FSDP2's own mean
    over edp: the negative control). Returns the experts' whole gradients. (A constant factor on a gradient hardly
    moves AdamW's step, so the control compares gradients.)"""
    from oslo_models import training
    from tests.training.test_global_batch_loss import _collate

    context = model.parallel_context
    model, _ = training.shard_data_parallel(model, None, zero_stage=3)
    if not scaled:
        for unit in expert_units(model):
            for key, hook in list(unit._forward_pre_hooks.items()):
                if isinstance(hook, GradientScale):
                    del unit._forward_pre_hooks[key]
    batch = _collate(rows[context.dp_rank * BATCH:(context.dp_rank + 1) * BATCH])
    local = training.count_label_tokens([batch], shifts_labels=True)
    model(**batch, num_items_in_batch=training.global_share(local, context)).loss.backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if ".experts." in n}


def _worker(paths, negative: bool):
    import transformers

    parallel = om.ParallelConfig(data_parallel_size=4, expert_parallel_size=2)
    rows = sft_rows(101, 48)
    for name, stage in CASES.items():
        if negative and name not in NEGATIVE:
            continue
        breadcrumb(name)
        model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=parallel).train()
        context = model.parallel_context
        units = expert_units(model)
        assert units and all(unit.gate_up_proj.to_local().shape[0] == EXPERTS // 2 for unit in units)
        reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
        if negative:  # the first step's expert gradients: right with the scale, off without it
            reference = reference_class.from_pretrained(paths[name]).train()
            from tests.training.test_global_batch_loss import _collate

            reference(**_collate(rows[:BATCH * context.dp_size])).loss.backward()
            expected = {n: p.grad for n, p in reference.named_parameters() if ".experts." in n}
            scaled = _first_gradients(model, rows, scaled=True)
            for n, grad in scaled.items():
                torch.testing.assert_close(grad, expected[n], atol=1e-6, rtol=1e-4)
            model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=parallel).train()
            unscaled = _first_gradients(model, rows, scaled=False)
            ratio = [float(grad.norm() / expected[n].norm()) for n, grad in unscaled.items()]
            assert all(abs(r - 2.0) < 1e-3 for r in ratio), ratio  # the mean over edp = 2: twice the gradient
            del model, reference
            continue
        model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=stage)
        reference, expected = reference_steps(reference_class.from_pretrained(paths[name]).train(), rows,
                                              BATCH * context.dp_size)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} logged losses: {m}")
        assert_same_parameters(model, reference)
        del model, reference


@pytest.mark.slow
def test_generic_expert_parallel(tmp_path):
    paths = save(tmp_path / "models", CASES)
    run_distributed(_worker, 4, paths, False, timeout=900)
    run_distributed(_worker, 4, paths, True, timeout=900)
