"""GPT-2 pipelined (every schedule, pp 2 and 4, with TP+SP and with DP) equals single-process ``transformers``:
loss, every gradient and the parameters after 3 AdamW steps; each stage holds only its own parameters; a save
from pp=2 x tp=2 opens in plain ``transformers`` with the same logits.

Few spawned worlds (2 CPU cores): each worker runs several layouts one after the other, since contexts with
different layouts can live in one process.
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.checkpointing import enable_checkpointing
from tests.helpers.dist import run_distributed
from tests.helpers.models import padded_batch, save_tiny_gpt2
from tests.helpers.pipeline import assert_pipeline_matches

NUM_LAYERS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer=NUM_LAYERS)


def _expected_names(model, layers) -> set[str]:
    """Parameter names a stage holding ``layers`` (plus embeddings/head on the first/last stage) must have."""
    layout = model.pipeline_layout
    names = {f"transformer.h.{i}.{leaf}" for i in layers for leaf in (
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
        "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
        "mlp.c_proj.bias")}
    if layout.has_first:
        names |= {"transformer.wte.weight", "transformer.wpe.weight"}
    if layout.has_last:
        names |= {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"}
    return names


def _run_layout(path: str, cfg: om.ParallelConfig, global_ids, global_mask, global_labels, *, save_to=None):
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    context, layout = model.parallel_context, model.pipeline_layout
    assert context.pp_size == cfg.pipeline_parallel_size
    # Each stage's resident parameters are only its own.
    assert {n for n, _ in model.named_parameters()} == _expected_names(model, layout.local_layers())
    assert sorted(layout.local_layers()) == sorted(i for s in layout.local_stages for i in layout.ranges[s])

    batch = {"input_ids": global_ids, "labels": global_labels}
    if global_mask is not None:
        batch["attention_mask"] = global_mask
    assert_pipeline_matches(model, reference, batch)
    if save_to is not None:
        model.save_pretrained(save_to)
        if context.rank == 0:
            loaded = transformers.GPT2LMHeadModel.from_pretrained(save_to).eval()
            reference.eval()
            torch.testing.assert_close(loaded(global_ids).logits, reference(global_ids).logits, atol=1e-5,
                                       rtol=1e-5)
            files = os.listdir(save_to)
            assert "model.safetensors" in files and "config.json" in files
        context.barrier()
    return model


def _world2_worker(path: str) -> None:
    ids, mask, labels = padded_batch(101, batch=4, seq=8)
    for schedule, virtual, microbatches in [("gpipe", 1, 2), ("1f1b", 1, 4), ("interleaved_1f1b", 2, 4),
                                            ("zero_bubble", 2, 4), ("zero_bubble", 1, 2)]:
        cfg = om.ParallelConfig(pipeline_parallel_size=2, pipeline_schedule=schedule, num_microbatches=microbatches,
                                virtual_pipeline_size=virtual)
        model = _run_layout(path, cfg, ids, mask, labels)
    # An explicit, uneven split runs the same numbers.
    cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=2, pipeline_partition=(3, 5))
    model = _run_layout(path, cfg, ids, mask, labels)
    assert len(model.pipeline_layout.local_layers()) == (3 if model.parallel_context.pp_rank == 0 else 5)
    with pytest.raises(ValueError, match="not divisible by num_microbatches"):
        model.train_step({"input_ids": ids[:3], "labels": labels[:3]})
    # A stage cannot run the whole model: forward and generate refuse clearly instead of failing half-way.
    with pytest.raises(RuntimeError, match="train_step"):
        model(ids)
    with pytest.raises(RuntimeError, match="cannot run with pipeline_parallel_size=2"):
        model.generate(ids[:1, :4], max_new_tokens=2)

    # from_config at pp=2 draws the weights transformers draws from the same seed; each stage keeps its own.
    config = transformers.GPT2Config.from_pretrained(path)
    torch.manual_seed(7)
    twin = transformers.GPT2LMHeadModel(config).train()
    torch.manual_seed(7)
    cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=2, pipeline_partition="parameters")
    model = om.AutoModelForCausalLM.from_config(config, parallel=cfg).train()
    assert_pipeline_matches(model, twin, {"input_ids": ids, "labels": labels, "attention_mask": mask}, steps=1)

    # Activation checkpointing inside the stages, also under zero-bubble's split backward.
    cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=2, pipeline_schedule="zero_bubble",
                            virtual_pipeline_size=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    enable_checkpointing(model)
    assert all(block.gradient_checkpointing for block in model.transformer.h)
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    assert_pipeline_matches(model, reference, {"input_ids": ids, "labels": labels, "attention_mask": mask}, steps=2)


def _world4_worker(path: str, save_to: str) -> None:
    ids, mask, labels = padded_batch(101, batch=4, seq=8)
    for schedule, virtual in [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]:
        cfg = om.ParallelConfig(pipeline_parallel_size=4, pipeline_schedule=schedule, num_microbatches=4,
                                virtual_pipeline_size=virtual)
        _run_layout(path, cfg, ids, mask, labels)
    cfg = om.ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                            num_microbatches=2)
    _run_layout(path, cfg, ids, mask, labels, save_to=save_to)
    # pp x dp on the padded batch: the replicas hold different label counts; the step's loss is the global batch's
    cfg = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, pipeline_schedule="1f1b",
                            num_microbatches=2)
    _run_layout(path, cfg, ids, mask, labels)


def test_pp2_every_schedule_matches_transformers(checkpoint):
    run_distributed(_world2_worker, 2, checkpoint)


def test_pp4_and_pp_tp_and_pp_dp_match_transformers(checkpoint, tmp_path):
    run_distributed(_world4_worker, 4, checkpoint, str(tmp_path / "saved"))
