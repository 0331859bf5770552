"""Context parallelism with the other axes, on one spawned group of 4 ranks: cp2 x pp2 (ring and all-to-all)
through ``model.train_step`` equals single-process ``transformers`` (the loss of each of 3 AdamW steps, every
gradient, the parameters after them; fp32, atol 1e-5)."""
from __future__ import annotations

import torch

import oslo_models as om
from oslo_models.data import ContextParallelSplitter
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.models import padded_batch
from tests.helpers.pipeline import assert_pipeline_matches

VOCAB, SEQ = 101, 16


def _batch(rows: int = 4) -> dict:
    ids, mask, labels = padded_batch(VOCAB, batch=rows, seq=SEQ)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _pipeline_matches(path: str, mode: str) -> None:
    cfg = om.ParallelConfig(pipeline_parallel_size=2, context_parallel_size=2, context_parallel_mode=mode,
                            num_microbatches=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    context = model.parallel_context
    assert (context.pp_size, context.cp_size, context.dp_size) == (2, 2, 1)
    reference = decoders.hf_class("llama").from_pretrained(path).train()
    batch = _batch()
    local = ContextParallelSplitter(context)(batch)
    assert_pipeline_matches(model, reference, batch, local=local)


def _worker(paths: dict) -> None:
    for mode in ("ring", "all_to_all"):
        _pipeline_matches(paths["llama"], mode)


def test_context_parallel_with_pipeline_matches_transformers(tmp_path):
    paths = {"llama": decoders.save_tiny(tmp_path / "llama", "llama", num_hidden_layers=4)}
    run_distributed(_worker, 4, paths, timeout=600)
