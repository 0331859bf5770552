"""peft adapters on a generic-path model at tensor parallelism are refused by ``training.prepare`` before any
collective, with the reason (peft would build each rank's adapter on its local shard: random A/B per rank, a
row-split adapter's output never summed over tp, so it would train silently away from the single-process adapter).
The same adapters at tp 1 x dp 2 are accepted and take a step (LoRA on the generic path at dp / ZeRO is what
``tests/image_text/test_image_text_lora.py`` and ``test_generic_pipeline_lora.py`` check for parity). An adapter
loaded from a folder at tp 2 takes its base layers' placements and is accepted (parity:
``test_generic_lora_tensor_parallel.py``); with sequence parallelism its load is refused, before any collective."""
from __future__ import annotations

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

import oslo_models as om
from accelerate import Accelerator
from oslo_models import training
from oslo_models.adapters import load_adapter
from tests.generic.models import save
from tests.helpers.dist import run_distributed


def _prepare(path, tp):
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=tp))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    rows = [{"input_ids": torch.arange(3, 11) + row, "labels": torch.arange(3, 11) + row} for row in range(4)]
    loader = DataLoader(rows, batch_size=2, collate_fn=lambda items: {
        key: torch.stack([item[key] for item in items]) for key in items[0]})
    return training.prepare(Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)


def _worker(path, adapter):
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    with pytest.raises(NotImplementedError, match=r"sequence_parallel"):
        load_adapter(om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel), adapter, is_trainable=True)
    model = load_adapter(om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(
        tensor_parallel_size=2)), adapter, is_trainable=True)
    training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-3))  # accepted: converted
    with pytest.raises(NotImplementedError, match=r"peft adapters on a generic-path .* tensor_parallel_size=2"):
        _prepare(path, 2)
    model, optimizer, loader = _prepare(path, 1)  # dp 2: accepted
    loss = model(**next(iter(loader))).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)


def test_generic_lora_at_tp_is_refused(tmp_path):
    path = save(tmp_path, ["granite"])["granite"]
    adapter = str(tmp_path / "adapter")
    get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path),
                   LoraConfig(r=4, target_modules=["q_proj", "o_proj"])).save_pretrained(adapter)
    run_distributed(_worker, 2, path, adapter)
