"""Llama-family decoders with pipeline and data parallelism, on 4 ranks: pp2 x tp2 (+ SP) through
``model.train_step`` equals single-process ``transformers`` (loss, every gradient, parameters after 3 AdamW steps)
for Llama (untied, biases) and Qwen2 (tied embeddings across stages, sliding window), then saves a checkpoint
``transformers`` opens; tp2 x dp2 through ``om.training.prepare`` with ZeRO-1 equals the single-process run on the
global batch for Qwen3 (q/k norms)."""
from __future__ import annotations

import os

import torch

import oslo_models as om
from accelerate import Accelerator
from oslo_models import training
from tests.helpers.decoders import VOCAB, hf_class, save_tiny
from tests.helpers.dist import run_distributed
from tests.helpers.models import assert_params_match
from tests.helpers.pipeline import ADAMW, assert_pipeline_matches


def _batch():
    ids = torch.randint(1, VOCAB, (4, 8), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids}


def _worker(paths: dict, out_root: str) -> None:
    for model_type in ("llama", "qwen2"):
        cfg = om.ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                                num_microbatches=2)
        model = om.AutoModelForCausalLM.from_pretrained(paths[model_type], parallel=cfg, progress=False).train()
        assert len(model.model.layers) == 2  # 4 layers, 2 per stage
        reference = hf_class(model_type).from_pretrained(paths[model_type]).train()
        assert_pipeline_matches(model, reference, _batch(), max_grad_norm=0.5)
        out = os.path.join(out_root, model_type)
        model.save_pretrained(out)
        if torch.distributed.get_rank() == 0:
            plain = hf_class(model_type).from_pretrained(out)
            ids = _batch()["input_ids"]
            assert set(plain.state_dict()) == set(reference.state_dict())
            # the parameters agree to 1e-5 after 3 steps (checked above); logits sum many of them
            torch.testing.assert_close(plain(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)

    # tp2 x dp2, ZeRO-1 through the training path: each replica sees half the global batch.
    batch = _batch()
    reference = hf_class("qwen3").from_pretrained(paths["qwen3"]).train()
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    cfg = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    model = om.AutoModelForCausalLM.from_pretrained(paths["qwen3"], parallel=cfg, progress=False).train()
    context = model.parallel_context
    assert (context.dp_size, context.tp_size) == (2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    prepared, optimizer = training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=1)
    local = {name: t.chunk(context.dp_size)[context.dp_rank] for name, t in batch.items()}
    for _ in range(3):
        expected = reference(**batch).loss
        expected.backward()
        ref_opt.step(), ref_opt.zero_grad()
        loss = prepared(**local).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=context.dp_group)
        torch.testing.assert_close(mean / context.dp_size, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_params_match(model, reference)


def test_pipeline_and_data_parallel_match_transformers(tmp_path):
    paths = {"llama": save_tiny(tmp_path / "llama", "llama", num_hidden_layers=4),
             "qwen2": save_tiny(tmp_path / "qwen2", "qwen2", num_hidden_layers=4),
             "qwen3": save_tiny(tmp_path / "qwen3", "qwen3")}
    run_distributed(_worker, 4, paths, str(tmp_path / "out"), timeout=600)
