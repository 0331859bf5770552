"""Pipeline parallelism in the 8-process layouts of issue 50 on generic types: pp 2 x tp 2 x dp 2 at ZeRO-1, and
the issue's example tp 2 + SP x pp 2 x cp 2 at ZeRO-1 on an MoE type.

One spawned group of 8 gloo processes, through ``training.prepare`` and ``model.train_step`` (1F1B, two microbatches
per replica) with a plain DataLoader of SFT rows whose label counts differ:

- cohere2 (tied embedding split by vocabulary over tp, sliding window) at pp 2 x tp 2 x dp 2, ZeRO-1: the DTensor
  parameters' optimizer state is split over dp (``training/dtensor_data_parallel.ShardedStateOptimizer``: each
  parameter stepped on one dp rank, its local tensor broadcast), which torch's ``ZeroRedundancyOptimizer`` cannot do;
- glm4_moe (MoE with shared experts, a dense first layer) at tp 2 + SP x pp 2 x cp 2 (ring), ZeRO-1: the stages
  exchange sequence slices of each rank's chunks, the chunks attend across cp, the MoE region routes the gathered
  sequence;
- glm4_moe at tp 2 + SP x pp 2 x cp 2 (ring) with ep 2 carved out of cp, ZeRO-1: the issue's example with its five
  axes, the experts split over the two cp ranks of each stage and tp rank (their optimizer state owned within their
  expert-data-parallel group), routed on the gathered sequence of each chunk;
- each: the logged loss of each of 3 AdamW steps and every parameter after them equal single-process
  ``transformers`` (fp32, 1e-5);
- negative controls: cohere2 with the ZeRO-1 owners' broadcast taken off (each rank keeps only the parameters it
  steps) and glm4_moe with the per-replica mean (``average_tokens_across_devices=False``) train away from it.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import oslo_models as om
from oslo_models import training
from oslo_models.generic.install_state import generic_install
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    ADAMW,
    STEPS,
    _collate,
    assert_same_parameters,
    parameters_differ,
    reference_steps,
    sft_rows,
)

BATCH = 4  # rows per replica and step: 2 microbatches of 2
PP = dict(pipeline_parallel_size=2, num_microbatches=2, tensor_parallel_size=2, zero_stage=1)
LAYOUTS = [  # (name, layout, negative control)
    ("cohere2", dict(PP, data_parallel_size=2), dict(broadcast=False)),
    ("glm4_moe", dict(PP, sequence_parallel=True, context_parallel_size=2), dict(average=False)),
    # the whole example, experts included, at its ZeRO-1
    ("glm4_moe", dict(PP, sequence_parallel=True, context_parallel_size=2, expert_parallel_size=2), None),
]


def _steps(model, rows, zero_stage, *, average=True, broadcast=True):
    """3 steps of the documented pipelined loop over ``training.prepare`` at ZeRO-1; ``broadcast=False`` takes the
    ZeRO-1 owners' broadcast off (the negative control). Returns the model and the logged (world-mean) losses."""
    from accelerate import Accelerator
    from oslo_models.training.dtensor_data_parallel import ShardedStateOptimizer

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    loader = DataLoader(rows, batch_size=BATCH, shuffle=False, collate_fn=_collate)
    model, optimizer, loader = training.prepare(accelerator, model, optimizer, loader, zero_stage=zero_stage,
                                                average_tokens_across_devices=average)
    inner = training.unwrap_model(model)
    if inner.parallel_context.dp_size > 1 and zero_stage == 1:
        assert isinstance(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer, ShardedStateOptimizer)
    if not broadcast:
        sharded = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        sharded._owner = {key: (None, owner) for key, (_, owner) in sharded._owner.items()}
    losses = []
    for micro in loader:
        loss = model.train_step(micro)
        optimizer.step(), optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        if len(losses) == STEPS:
            break
    return inner, losses


def _worker(paths):
    import transformers

    rows = sft_rows(101, 48)
    for name, layout, broken in LAYOUTS:
        for control in (False, True) if broken else (False,):
            breadcrumb(f"{name} {layout} negative control {control}")
            model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=om.ParallelConfig(**layout)).train()
            context = model.parallel_context
            assert bool(generic_install(model).sequence_parallel) == context.config.sequence_parallel
            assert (model.config._attn_implementation == "oslo_context_parallel") == (context.cp_size > 1)
            model, logged = _steps(model, rows, layout["zero_stage"], **(broken if control else {}))
            reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
            reference, expected = reference_steps(reference_class.from_pretrained(paths[name]).train(), rows,
                                                  BATCH * context.dp_size)
            if control:
                assert parameters_differ(model, reference), f"{name}: the broken run matched transformers"
            else:
                torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{name} {layout} logged losses: {m}")
                assert_same_parameters(model, reference)
            del model, reference


@pytest.mark.slow
def test_generic_pipeline_on_eight_ranks(tmp_path):
    paths = save(tmp_path / "models", ["cohere2", "glm4_moe"])
    run_distributed(_worker, 8, paths, timeout=1500)
