"""Resumable checkpoints of a pipelined generic causal LM at another layout (``training.save_checkpoint`` /
``load_checkpoint``; ``generic/checkpoint.py``).

One spawned group of 4 gloo processes. Granite (untied) and Cohere 2 (tied embeddings: the first stage's embedding
and the last stage's head are one tensor) train 2 AdamW steps at pp 2 x dp 2 ZeRO-3 and save; each checkpoint is
resumed at dp 4 ZeRO-0, dp 4 ZeRO-3 and pp 2 x tp 2: the third step's logged loss and every parameter
after it equal single-process ``transformers`` trained 3 steps uninterrupted on the same global batches (fp32,
1e-5; rows with unequal label counts). The reverse too: 2 steps at dp 4 ZeRO-3, resumed at pp 2 x dp 2 ZeRO-3. A
tied tensor is stored once, under the embedding's name (the name a pp = 1 model has), so a checkpoint of either
layout holds the same entries. Negative control: a resume that leaves the optimizer state out (the model's weights
loaded alone) misses the reference.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from oslo_models import training
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.global_loss import with_global_share
from tests.helpers.pipeline import ADAMW
from tests.training.test_global_batch_loss import _collate, assert_same_parameters, parameters_differ, sft_rows

ROWS = 8  # global batch of a step, at every layout
PIPELINED = dict(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
RESUMED = ((0, dict(data_parallel_size=4)), (3, dict(data_parallel_size=4)))
# cohere2 here was the negative control of pipeline/stage.py's tied-gradient sum: its vocabulary-split tied
# gradient came back replicated on one stage and the sum aborted (gloo size mismatch) before the layout matched
TENSOR_PARALLEL = (0, dict(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2))


def _build(path, zero_stage, layout):
    model = om.AutoModelForCausalLM.from_pretrained(
        path, parallel=om.ParallelConfig(zero_stage=zero_stage, **layout)).train()
    from accelerate import Accelerator

    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    return training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=zero_stage)


def _step(model, optimizer, rows, step) -> float:
    """One optimizer step on global rows ``[step R, (step + 1) R)``, replica ``d`` its ``d``-th block; the logged
    loss (world mean)."""
    inner = training.unwrap_model(model)
    context = inner.parallel_context
    per = ROWS // context.dp_size
    start = step * ROWS + context.dp_rank * per
    local = with_global_share(inner, _collate(rows[start:start + per]), True)
    if context.pp_size > 1:
        loss = model.train_step(local)
    else:
        loss = model(**local).loss
        loss.backward()
    optimizer.step(), optimizer.zero_grad()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _reference(path, rows):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(3):
        loss = model(**_collate(rows[step * ROWS:(step + 1) * ROWS])).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
    return model, loss.item()


def _train_and_save(path, folder, zero_stage, layout, rows):
    model, optimizer = _build(path, zero_stage, layout)
    for step in range(2):
        _step(model, optimizer, rows, step)
    return training.save_checkpoint(folder, model, optimizer, step=2)


def _resume(name, path, folder, zero_stage, layout, rows, reference, expected, *, optimizer_state=True):
    breadcrumb(f"{name} resume at {layout} zero{zero_stage}")
    model, optimizer = _build(path, zero_stage, layout)
    info = training.load_checkpoint(folder, model, optimizer if optimizer_state else None)
    assert info["step"] == 2 and not info["same_layout"]
    loss = _step(model, optimizer, rows, 2)
    inner = training.unwrap_model(model)
    if not optimizer_state:
        assert parameters_differ(inner, reference), f"{name}: a resume without the optimizer state matched"
        return
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{name} at {layout} zero{zero_stage}: loss {m}")
    assert_same_parameters(inner, reference)


def _worker(paths, root):
    rows = sft_rows(101, 48)
    for name, path in paths.items():
        reference, expected = _reference(path, rows)
        breadcrumb(f"{name} pp2 x dp2 zero3")
        folder = os.path.join(root, f"{name}_pp")
        saved = _train_and_save(path, folder, 3, PIPELINED, rows)
        if name == "cohere2":  # a tied tensor is stored once, under the embedding's (pp = 1) name
            from torch.distributed.checkpoint import FileSystemReader

            keys = FileSystemReader(saved).read_metadata().state_dict_metadata
            assert "model/model.embed_tokens.weight" in keys and "model/lm_head.weight" not in keys
        for zero_stage, layout in RESUMED + (TENSOR_PARALLEL,):
            _resume(name, path, folder, zero_stage, layout, rows, reference, expected)
        breadcrumb(f"{name} dp4 zero3 -> pp2 x dp2")
        folder = os.path.join(root, f"{name}_dp")
        _train_and_save(path, folder, 3, dict(data_parallel_size=4), rows)
        _resume(name, path, folder, 3, PIPELINED, rows, reference, expected)
        if name == "granite":  # negative control
            _resume(name, path, folder, 3, PIPELINED, rows, reference, expected, optimizer_state=False)


@pytest.mark.slow
def test_generic_pipeline_resumes_at_other_layouts(tmp_path):
    paths = save(tmp_path / "models", ("granite", "cohere2"))
    run_distributed(_worker, 4, paths, str(tmp_path / "checkpoints"), timeout=900)
