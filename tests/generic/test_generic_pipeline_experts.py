"""Pipeline parallelism with expert parallelism and the load-balancing loss on generic MoE types (issue 50).

One spawned group of 4 gloo processes, through ``training.prepare`` and ``model.train_step`` (1F1B, two microbatches
per replica) with a plain DataLoader of SFT rows whose label counts differ:

- pp 2 x ep 2 inside dp 2 (ZeRO-0): dots1 (a dense first layer, then MoE with DeepSeek's grouped sigmoid router) and
  minimax_m2 (MoE in every layer, sigmoid router): the experts' gradients summed over the ranks holding the same
  experts and divided by ``dp x cp`` by the pipeline runner; the logged loss of each of 3 AdamW steps and every
  parameter after them equal single-process ``transformers`` (fp32, 1e-5);
- the load-balancing loss (``output_router_logits=True``, coefficient 0.5) carried across the stages as routing
  statistics (``generic/router_loss.py``): minimax_m2 at pp 2 x ep 2 in dp 2, ernie4_5_moe at pp 2 x tp 2 + SP and
  qwen3_next (gated-DeltaNet hybrid) at pp 2 x dp 2 ZeRO-3, minimax_m2 at pp 2 x cp 2 (ring) with ep 2 carved out of
  cp (the chunks' statistics summed over cp before the product). Each microbatch's router term is its own (as gradient
  accumulation over the microbatches gives it in ``transformers``): the reference is ``transformers`` on the global
  batch's token loss plus the mean of every microbatch's router term;
- negative controls: dots1 with the experts averaged over dp like dense weights, minimax_m2 with the router term
  left out of the stages' loss, and minimax_m2 under cp with each chunk's own statistics (not summed over cp) all
  train away from the reference.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.generic.install_state import generic_install
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    _collate,
    assert_same_parameters,
    parameters_differ,
    prepared_steps,
    reference_steps,
    sft_rows,
)

BATCH, MICROBATCHES = 4, 2  # rows per replica and step
PP = dict(pipeline_parallel_size=2, num_microbatches=MICROBATCHES)
EP = dict(PP, data_parallel_size=2, expert_parallel_size=2)
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.5)
LAYOUTS = [("dots1", EP, 0, False), ("minimax_m2", EP, 0, False), ("minimax_m2", EP, 0, True),
           ("ernie4_5_moe", dict(PP, tensor_parallel_size=2, sequence_parallel=True), 0, True),
           ("qwen3_next", dict(PP, data_parallel_size=2), 3, True),
           ("minimax_m2", dict(PP, context_parallel_size=2, expert_parallel_size=2), 0, True)]
# (name, layout, zero stage, router loss)
NEGATIVE = [("dots1", EP, "experts"), ("minimax_m2", EP, "router"),
            ("minimax_m2", dict(PP, context_parallel_size=2, expert_parallel_size=2), "chunk")]


def _microbatch_reference_steps(reference, rows, dp: int):
    """``transformers`` on each step's global batch: its token loss plus the mean over every replica's
    microbatches of their own router terms (``tests/helpers/global_loss.py``: each part's token loss weighted by
    its share of the global label count)."""
    from tests.helpers.global_loss import part_reference_steps

    return part_reference_steps(reference, rows, dp * MICROBATCHES, BATCH // MICROBATCHES, _collate)


def _train(name, path, layout, zero_stage, router: bool, rows, broken=None):
    import transformers

    options = ROUTER if router else {}
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**layout), **options).train()
    context = model.parallel_context
    if context.ep_size > 1 and model.pipeline_layout.has_last:  # (layer 0 of dots1 is dense)
        assert model._pipeline_runner()._expert_parameters(), f"{name}: no experts split over ep on the last stage"
    if broken == "experts":  # the experts averaged over dp like dense weights
        model._pipeline_runner()._expert_parameters = dict
    elif broken == "router":  # the stages' loss without the router term
        adapter = generic_install(model).pipeline_adapter
        adapter.microbatch_loss = lambda model, outputs, labels, items, count: adapter.loss(model, outputs[0], labels,
                                                                                            items)
    elif broken == "chunk":  # under cp, each chunk's own statistics (not summed over cp) for the router term
        from oslo_models.models.mixtral.pipeline_mixtral import aux_loss_from_statistics

        adapter = generic_install(model).pipeline_adapter

        def chunk_loss(model, outputs, labels, items, count):
            aux = aux_loss_from_statistics(outputs[1], model.num_experts) / model.parallel_context.cp_size
            return adapter.loss(model, outputs[0], labels, items) + model.router_aux_loss_coef * aux / count

        adapter.microbatch_loss = chunk_loss
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=zero_stage)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, **options).train()
    if router:
        reference, expected = _microbatch_reference_steps(reference, rows, context.dp_size)
    else:
        reference, expected = reference_steps(reference, rows, BATCH * context.dp_size)
    return model, reference, logged, expected


def _worker(paths):
    rows = sft_rows(101, 48)
    for name, layout, zero_stage, router in LAYOUTS:
        breadcrumb(f"{name} {layout} zero{zero_stage} router loss {router}")
        model, reference, logged, expected = _train(name, paths[name], layout, zero_stage, router, rows)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} {layout} logged losses: {m}")
        assert_same_parameters(model, reference)
        del model, reference
    for name, layout, what in NEGATIVE:
        breadcrumb(f"negative control {what}: {name}")
        model, reference, logged, expected = _train(name, paths[name], layout, 0, what != "experts", rows, what)
        assert parameters_differ(model, reference), f"{what}: the broken {name} matched transformers"
        del model, reference


@pytest.mark.slow
def test_generic_pipeline_expert_parallel_and_router_loss(tmp_path):
    paths = save(tmp_path / "models", ["dots1", "minimax_m2", "ernie4_5_moe", "qwen3_next"])
    run_distributed(_worker, 4, paths, timeout=900)
