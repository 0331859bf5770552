"""Hub checkpoints both ways: sliced loading (single file, sharded index, legacy .bin), gathered saving that plain
``transformers`` opens, key-by-key identity of a round trip, seeded init equal at every tp, and greedy
``generate`` under TP equal to ``transformers``."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.models import assert_params_match, padded_batch, save_tiny_gpt2, tiny_gpt2_config


def _load_all_safetensors(folder: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def _round_trip_worker(source: str, out_single: str, out_sharded: str) -> None:
    cfg = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    model = om.AutoModelForCausalLM.from_pretrained(source, parallel=cfg, progress=False)
    model.save_pretrained(out_single)
    model.save_pretrained(out_sharded, max_shard_size="20KB")
    # Sliced loading from the sharded checkpoint gives the same model again.
    again = om.AutoModelForCausalLM.from_pretrained(out_sharded, parallel=cfg, progress=False)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    if torch.distributed.get_rank() == 0:
        original = _load_all_safetensors(source)
        for folder in (out_single, out_sharded):
            saved = _load_all_safetensors(folder)
            assert saved.keys() == original.keys()
            for key in original:
                assert torch.equal(saved[key], original[key]), key
        assert os.path.exists(os.path.join(out_sharded, "model.safetensors.index.json"))
        assert json.load(open(os.path.join(out_single, "config.json")))["architectures"] == ["GPT2LMHeadModel"]


def test_save_round_trip_is_exact_key_by_key(tmp_path):
    source = save_tiny_gpt2(tmp_path / "src")
    run_distributed(_round_trip_worker, 2, source, str(tmp_path / "single"), str(tmp_path / "sharded"))
    ids, mask, _ = padded_batch(101)
    reference = transformers.GPT2LMHeadModel.from_pretrained(source)
    for folder in ("single", "sharded"):
        plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / folder)
        torch.testing.assert_close(plain(ids, attention_mask=mask).logits,
                                   reference(ids, attention_mask=mask).logits, atol=0, rtol=0)


def _trained_save_worker(source: str, out: str) -> None:
    cfg = om.ParallelConfig(tensor_parallel_size=2)
    model = om.AutoModelForCausalLM.from_pretrained(source, parallel=cfg, progress=False).train()
    ids, mask, labels = padded_batch(101)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    opt.step()
    model.eval()
    logits = model(ids, attention_mask=mask).logits
    model.save_pretrained(out)
    if torch.distributed.get_rank() == 0:
        plain = transformers.GPT2LMHeadModel.from_pretrained(out)
        torch.testing.assert_close(plain(ids, attention_mask=mask).logits, logits, atol=1e-5, rtol=1e-5)
        # training moved the weights: the check above is not comparing the untouched checkpoint with itself
        assert not torch.allclose(plain.transformer.wte.weight,
                                  transformers.GPT2LMHeadModel.from_pretrained(source).transformer.wte.weight)


def test_trained_tp_model_saves_what_transformers_reloads(tmp_path):
    source = save_tiny_gpt2(tmp_path / "src")
    run_distributed(_trained_save_worker, 2, source, str(tmp_path / "out"))


def _from_config_worker(tp: int) -> None:
    config = tiny_gpt2_config(vocab_size=103)
    torch.manual_seed(7)
    reference = transformers.GPT2LMHeadModel(config)
    torch.manual_seed(7)
    model = om.AutoModelForCausalLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=tp))
    assert_params_match(model, reference, atol=0, rtol=0)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("tp", [1, 2])
def test_from_config_initializes_like_transformers_at_any_tp(tp):
    if tp == 1:
        _from_config_worker(1)
    else:
        run_distributed(_from_config_worker, tp, tp)


def _generate_worker(source: str) -> None:
    model = om.AutoModelForCausalLM.from_pretrained(
        source, parallel=om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True), progress=False)
    reference = transformers.GPT2LMHeadModel.from_pretrained(source)
    prompt = torch.tensor([[5, 17, 42, 3, 9, 11], [0, 0, 8, 21, 33, 4]])  # second row left-padded
    mask = (torch.arange(6) >= torch.tensor([[0], [2]])).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours = model.generate(prompt, **kwargs)
    theirs = reference.generate(prompt, **kwargs)
    assert ours.shape == theirs.shape == (2, 18)
    assert torch.equal(ours, theirs)


def test_generate_greedy_under_tp_equals_transformers(tmp_path):
    run_distributed(_generate_worker, 2, save_tiny_gpt2(tmp_path / "src"))


def test_legacy_bin_and_prefixless_checkpoints_load(tmp_path):
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    base_only = tmp_path / "base"
    reference.transformer.save_pretrained(base_only)  # keys without the "transformer." prefix, as on the Hub
    ids, mask, _ = padded_batch(101)
    expected = reference(ids, attention_mask=mask).logits
    model = om.GPT2LMHeadModel.from_pretrained(base_only, progress=False)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, atol=1e-6, rtol=1e-6)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save(reference.state_dict(), legacy / "pytorch_model.bin")
    reference.config.save_pretrained(legacy)
    model = om.AutoModelForCausalLM.from_pretrained(legacy, progress=False)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, atol=1e-6, rtol=1e-6)


def test_sequence_classification_matches_transformers(tmp_path):
    path = save_tiny_gpt2(tmp_path / "cls", cls=transformers.GPT2ForSequenceClassification, num_labels=3)
    run_distributed(_classification_worker, 2, path)


def _classification_worker(path: str) -> None:
    reference = transformers.GPT2ForSequenceClassification.from_pretrained(path)
    model = om.AutoModelForSequenceClassification.from_pretrained(
        path, parallel=om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True), progress=False)
    ids, mask, _ = padded_batch(101)
    labels = torch.tensor([0, 2, 1])
    expected = reference(ids, attention_mask=mask, labels=labels)
    got = model(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
