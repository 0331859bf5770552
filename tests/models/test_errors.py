"""Bad input gets a clear error before any collective runs: never a hang, never a half-written folder."""
from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.models import save_tiny_gpt2, tiny_gpt2_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


def test_heads_not_divisible(checkpoint):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        om.AutoModelForCausalLM.from_pretrained(checkpoint, parallel=om.ParallelConfig(tensor_parallel_size=3))


def test_inner_size_not_divisible():
    config = tiny_gpt2_config(n_head=2, n_inner=33)
    with pytest.raises(ValueError, match="n_inner=33"):
        om.AutoModelForCausalLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=2))


def test_world_size_mismatch_single_process(checkpoint):
    with pytest.raises(ValueError, match="launched world has 1 process"):
        om.AutoModelForCausalLM.from_pretrained(checkpoint, parallel=om.ParallelConfig(tensor_parallel_size=2))


def _world_mismatch_worker(path):
    with pytest.raises(ValueError, match="launched world has 2 process"):
        om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=4))


def test_world_size_mismatch_under_torchrun(checkpoint):
    run_distributed(_world_mismatch_worker, 2, checkpoint, timeout=120)


def test_unknown_option(checkpoint):
    with pytest.raises(ValueError, match="tensor_paralel_size"):
        om.ParallelConfig.from_dict({"tensor_paralel_size": 2})
    with pytest.raises(ValueError, match="Unknown from_pretrained option"):
        om.AutoModelForCausalLM.from_pretrained(checkpoint, not_an_option=3)
    with pytest.raises(ValueError, match="must be a ParallelConfig"):
        om.AutoModelForCausalLM.from_pretrained(checkpoint, parallel={"tensor_parallel_size": 2})


def test_missing_shard(tmp_path):
    folder = tmp_path / "sharded"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(folder, max_shard_size="20KB")
    index = json.load(open(folder / "model.safetensors.index.json"))
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(folder / victim)
    with pytest.raises(FileNotFoundError, match=victim):
        om.AutoModelForCausalLM.from_pretrained(folder)


def test_no_weights_at_all(tmp_path):
    tiny_gpt2_config().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="No model weights"):
        om.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_truncated_safetensors(checkpoint, tmp_path):
    folder = tmp_path / "truncated"
    folder.mkdir()
    for name in os.listdir(checkpoint):
        data = open(os.path.join(checkpoint, name), "rb").read()
        if name.endswith(".safetensors"):
            data = data[: len(data) // 2]
        open(folder / name, "wb").write(data)
    with pytest.raises(ValueError, match="truncated"):
        om.AutoModelForCausalLM.from_pretrained(folder)


def test_unsupported_model_type(tmp_path):
    # A type with no native family trains through transformers' own class (the generic path); only a type
    # transformers has no class for either is unsupported.
    transformers.ViTConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Unsupported model type 'vit'"):
        om.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_failed_save_leaves_previous_checkpoint_and_no_partial_folder(checkpoint, tmp_path):
    model = om.AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    out = tmp_path / "out"
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text("{}")  # a user's file next to the weights survives re-saves
    before = {name: open(out / name, "rb").read() for name in os.listdir(out)}
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)
    # the disk fills while the tensors' bytes are written (every rank's writer: conversion/hub_export.py)
    with mock.patch("oslo_models.conversion.hub_export.pwrite_all", side_effect=OSError("disk full")):
        with pytest.raises(OSError, match="disk full"):
            model.save_pretrained(out)
    after = {name: open(out / name, "rb").read() for name in os.listdir(out)}
    assert after == before
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging folder left behind
    model.save_pretrained(out)
    assert (out / "tokenizer.json").exists()
    assert open(out / "model.safetensors", "rb").read() != before["model.safetensors"]
