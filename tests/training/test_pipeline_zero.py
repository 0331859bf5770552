"""Pipeline x data parallelism through the training path: ``om.training.prepare`` with ZeRO-1 on a pp=2 x dp=2
GPT-2 (and pp=2 x tp=2 alone for the clipping norm), 3 clipped AdamW steps equal single-process ``transformers``:
loss, every gradient, the global gradient norm (tied embedding counted once) and the parameters after each step.
Optimizer state is really sharded: each dp rank's ZeRO partition holds part of its stage, together all of it.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from accelerate import Accelerator
from torch.distributed.optim import ZeroRedundancyOptimizer

import oslo_models as om
from oslo_models import training
from tests.helpers.dist import run_distributed
from tests.helpers.models import save_tiny_gpt2
from tests.helpers.pipeline import ADAMW, assert_pipeline_matches


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer=4)


def _dense_batch():
    ids = torch.randint(1, 101, (8, 8), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids}


def _worker(path: str) -> None:
    batch = _dense_batch()  # equal token counts per replica: the mean of replica means is the global mean
    cfg = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2,
                            pipeline_schedule="1f1b")
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    context = model.parallel_context
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    prepared, optimizer = training.prepare(accelerator, model, optimizer, zero_stage=1)
    assert prepared is model  # the pipeline runner synchronizes gradients; no DDP wrapper
    zero = training.zero.unwrap_optimizer(optimizer)
    assert isinstance(zero, ZeroRedundancyOptimizer)

    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    assert_pipeline_matches(model, reference, batch, optimizer=optimizer, max_grad_norm=0.5)

    # ZeRO-1 state is sharded over dp within each stage: this rank's partition is a strict part of its stage,
    # and the dp ranks' partitions together cover the stage exactly once.
    owned = sum(p.numel() for group in zero.optim.param_groups for p in group["params"])
    stage_total = sum(p.numel() for p in model.parameters())
    assert 0 < owned < stage_total
    counts = torch.tensor([owned])
    torch.distributed.all_reduce(counts, group=context.dp_group)
    assert int(counts) == stage_total

    with pytest.raises(ValueError, match="num_microbatches"):
        training.prepare(Accelerator(cpu=True, gradient_accumulation_steps=2), model)
    fresh = torch.optim.AdamW(model.parameters(), **ADAMW)
    with pytest.raises(NotImplementedError, match="zero_stage=2 with pipeline_parallel_size"):
        training.shard_data_parallel(om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False),
                                     fresh, zero_stage=2)

    # pp x tp: the norm adds tp-split shards over tp and stages over pp, the tied wte/lm_head once.
    cfg = om.ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    assert_pipeline_matches(model, reference, batch, steps=2, max_grad_norm=0.5)


def test_pipeline_zero1_and_clipping_match_transformers(checkpoint):
    run_distributed(_worker, 4, checkpoint)
