"""peft adapters on a generic-path model at tensor parallelism are refused by ``training.prepare`` before any
collective, with the reason (peft would build each rank's adapter on its local shard: random A/B per rank, a
row-split adapter's output never summed over tp, so it would train silently away from the single-process adapter).
The same adapters at tp 1 x dp 2 are accepted and take a step (LoRA on the generic path at dp / ZeRO is what
``tests/image_text/test_image_text_lora.py`` and ``test_generic_pipeline_lora.py`` check for parity)."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

import oslo_models as om
from accelerate import Accelerator
from oslo_models import training
from tests.generic.models import save
from tests.helpers.dist import run_distributed


def _prepare(path, tp):
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=tp))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    rows = [{"input_ids": torch.arange(3, 11) + row, "labels": torch.arange(3, 11) + row} for row in range(4)]
    loader = DataLoader(rows, batch_size=2, collate_fn=lambda items: {
        key: torch.stack([item[key] for item in items]) for key in items[0]})
    return training.prepare(Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)


def _worker(path):
    with pytest.raises(NotImplementedError, match=r"peft adapters on a generic-path .* tensor_parallel_size=2"):
        _prepare(path, 2)
    model, optimizer, loader = _prepare(path, 1)  # dp 2: accepted
    loss = model(**next(iter(loader))).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)


def test_generic_lora_at_tp_is_refused(tmp_path):
    run_distributed(_worker, 2, save(tmp_path, ["granite"])["granite"])
