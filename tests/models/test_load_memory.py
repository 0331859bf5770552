"""Sliced loading keeps each rank's host memory near its shard: at tp=4, the peak RSS growth of
``from_pretrained`` on a ~100M-parameter GPT-2 is at most 0.35x the checkpoint (transformers loads it all)."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.utils import PeakRSS
from tests.helpers.dist import run_distributed


def _load_worker(path: str, model_bytes: int, limit: float) -> None:
    cfg = om.ParallelConfig(tensor_parallel_size=4)
    context = om.ParallelContext.from_config(cfg)  # process groups first: their buffers are not the model's
    auto = om.AutoModelForCausalLM  # imported here (names import lazily): module code is not the model's memory
    auto.model_class_for(transformers.AutoConfig.from_pretrained(path))  # and the family's model code, likewise
    with PeakRSS() as peak:
        model = auto.from_pretrained(path, parallel=context, progress=False)
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert local_bytes < 0.27 * model_bytes  # the model really is split: this rank holds ~1/4
    ratio = peak.growth_bytes / model_bytes
    print(f"rank {context.rank}: peak RSS growth {peak.growth_bytes / 2**20:.0f} MiB = {ratio:.2f}x of "
          f"{model_bytes / 2**20:.0f} MiB")
    assert ratio <= limit, f"rank {context.rank} grew {ratio:.2f}x the model bytes during from_pretrained"


@pytest.mark.slow
def test_tp4_peak_rss_growth_is_a_fraction_of_the_model(tmp_path):
    config = transformers.GPT2Config(n_embd=768, n_layer=10, n_head=12, vocab_size=32000, n_positions=512)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in transformers.GPT2LMHeadModel(config).parameters())
    assert 90e6 < num_params < 110e6
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model_bytes = os.path.getsize(tmp_path / "model.safetensors")
    run_distributed(_load_worker, 4, str(tmp_path), model_bytes, 0.35, timeout=600)
