"""Checkpoint integrity, single process: the full stored shape is checked before slicing, the index is checked
against the headers, unreadable files and bad options are named, validation runs for every ``parallel=`` form,
and a Hub folder is replaced atomically (stale shard layouts never remain, the mode is the umask's)."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import oslo_models as om
from oslo_models.conversion import atomic
from oslo_models.distributed.context import AxisInfo
from tests.helpers.models import save_tiny_gpt2, tiny_gpt2_config

IDS = torch.tensor([[1, 5, 9, 33, 7, 2]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


def short_vocab_checkpoint(folder) -> str:
    """A checkpoint whose wte has 99 rows while its config says vocab_size=100 (pads like 100 at tp=2)."""
    save_tiny_gpt2(folder, vocab_size=99)
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    config["vocab_size"] = 100
    open(os.path.join(folder, "config.json"), "w").write(json.dumps(config))
    return str(folder)


def hf_logits(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(IDS).logits


def test_short_vocab_refused_at_tp1(tmp_path):
    folder = short_vocab_checkpoint(tmp_path / "short")
    with pytest.raises(ValueError, match=r"'transformer.wte.weight' has shape \(99, 32\), but the model config "
                                         r"needs \(100, 32\)"):
        om.AutoModelForCausalLM.from_pretrained(folder, progress=False)


def test_transposed_packed_qkv_is_named(checkpoint, tmp_path):
    folder = tmp_path / "transposed"
    folder.mkdir()
    for name in os.listdir(checkpoint):
        if name != "model.safetensors":
            open(folder / name, "wb").write(open(os.path.join(checkpoint, name), "rb").read())
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    key = "transformer.h.0.attn.c_attn.weight"
    weights[key] = weights[key].t().contiguous()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_attn.weight' has shape \(96, 32\), but the model "
                                         r"config needs \(32, 96\) .*\(transposed") as caught:
        om.AutoModelForCausalLM.from_pretrained(folder, progress=False)
    assert "tensor_parallel_size" not in str(caught.value)  # the old message called the q|k|v count a tp size


class _NotATensor:
    pass


def test_pickle_refused_by_weights_only_names_the_file(checkpoint, tmp_path):
    folder = tmp_path / "pickled"
    tiny_gpt2_config().save_pretrained(folder)
    torch.save({"transformer.wte.weight": torch.zeros(2), "payload": _NotATensor()}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin could not be read safely with "
                                         r"torch.load\(weights_only=True\).*UnpicklingError"):
        om.AutoModelForCausalLM.from_pretrained(folder, progress=False)


def sharded_copy(tmp_path, name="sharded") -> tuple[str, dict]:
    folder = tmp_path / name
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(folder, max_shard_size="20KB")
    index = json.load(open(folder / "model.safetensors.index.json"))
    return str(folder), index


def test_index_naming_the_wrong_shard_is_followed(tmp_path, caplog):
    folder, index = sharded_copy(tmp_path)
    by_shard = {}
    for k, v in sorted(index["weight_map"].items()):
        by_shard.setdefault(v, []).append(k)
    home = next(shard for shard, keys in sorted(by_shard.items()) if len(keys) > 1)  # stays listed in the index
    key, wrong = by_shard[home][0], next(shard for shard in sorted(by_shard) if shard != home)
    index["weight_map"][key] = wrong  # transformers still loads this checkpoint
    json.dump(index, open(os.path.join(folder, "model.safetensors.index.json"), "w"))
    with caplog.at_level("WARNING", logger="oslo_models.conversion.checkpoint"):
        model = om.AutoModelForCausalLM.from_pretrained(folder, progress=False)
    assert f"{key!r} -> {wrong}" in caplog.text and f"it is in {home}" in caplog.text
    torch.testing.assert_close(model(IDS).logits, hf_logits(folder), atol=1e-5, rtol=1e-5)


def test_index_entry_no_shard_holds_is_named(tmp_path):
    folder, index = sharded_copy(tmp_path)
    filename = index["weight_map"]["transformer.h.1.mlp.c_fc.weight"]
    shard = load_file(os.path.join(folder, filename))
    del shard["transformer.h.1.mlp.c_fc.weight"]
    save_file(shard, os.path.join(folder, filename), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lists tensor\(s\) that no shard holds: 'transformer.h.1.mlp.c_fc.weight'"
                                         rf" -> {filename}"):
        om.AutoModelForCausalLM.from_pretrained(folder, progress=False)


@pytest.mark.parametrize("options, option", [({"seed": 2**64 + 1}, "seed"), ({"seed": -1}, "seed"),
                                             ({"zero_stage": True}, "zero_stage"),
                                             ({"zero_stage": 1.0}, "zero_stage")])
def test_config_values_named(options, option):
    with pytest.raises(ValueError, match=f"ParallelConfig.{option} must be"):
        om.ParallelConfig(**options)


def test_from_json_errors_name_the_input(tmp_path):
    with pytest.raises(ValueError, match="must hold a JSON object .* got a JSON list"):
        om.ParallelConfig.from_json("[1, 2]")
    path = tmp_path / "cfg.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{path} must hold a JSON object"):
        om.ParallelConfig.from_json(path)
    with pytest.raises(FileNotFoundError, match="'missing.json' is neither a file nor JSON text"):
        om.ParallelConfig.from_json("missing.json")
    assert om.ParallelConfig.from_json('{"zero_stage": 2}').zero_stage == 2


def fake_context(tp: int) -> om.ParallelContext:
    """A context claiming ``tp`` tensor-parallel ranks with no process group: validation must refuse the model
    before anything would touch a group."""
    axes = {"pp": AxisInfo(None, 1, 0, (0,)), "dp": AxisInfo(None, 1, 0, (0,)),
            "tp": AxisInfo(None, tp, 0, tuple(range(tp)))}
    return om.ParallelContext(om.ParallelConfig(tensor_parallel_size=tp), world_size=tp, rank=0,
                              device=torch.device("cpu"), axes=axes)


def test_validation_runs_for_a_parallel_context(checkpoint):
    config = tiny_gpt2_config(n_embd=96, n_head=4)
    context = fake_context(3)
    message = "num_attention_heads=4 is not divisible by tensor_parallel_size=3"
    with pytest.raises(ValueError, match=message):
        om.AutoModelForCausalLM.from_config(config, parallel=context)
    with pytest.raises(ValueError, match=message):
        om.AutoModelForCausalLM.from_pretrained(checkpoint, parallel=context, progress=False)
    with pytest.raises(ValueError, match=message):  # direct construction, as pipeline/example code does
        om.models.gpt2.GPT2LMHeadModel(config, parallel_context=context)


def test_automodel_base_from_head_checkpoint(checkpoint):
    """Keys saved with the head's prefix (``transformer.h.0...``) fill the base model, not random weights."""
    ours = om.AutoModel.from_pretrained(checkpoint, progress=False)
    reference = transformers.AutoModel.from_pretrained(checkpoint).eval()
    torch.testing.assert_close(ours(IDS).last_hidden_state, reference(IDS).last_hidden_state, atol=1e-5, rtol=1e-5)
    random = om.AutoModel.from_config(tiny_gpt2_config())  # negative control: a base model that did not load
    assert not torch.allclose(random(IDS).last_hidden_state, reference(IDS).last_hidden_state, atol=1e-3)


# ---------------------------------------------------------------------------------------------- Hub folder writes
def _weight_files(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("model"))


def test_resave_other_shard_layout_leaves_no_stale_files(checkpoint, tmp_path):
    out = tmp_path / "out"
    first = om.AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    first.save_pretrained(out, max_shard_size="20KB")
    (out / "tokenizer.json").write_text("{}")
    assert "model.safetensors.index.json" in _weight_files(out)
    second = om.AutoModelForCausalLM.from_config(tiny_gpt2_config())  # other weights, one file
    second.save_pretrained(out)
    assert _weight_files(out) == ["model.safetensors"] and (out / "tokenizer.json").exists()
    torch.testing.assert_close(hf_logits(out), second(IDS).logits, atol=1e-5, rtol=1e-5)
    first.save_pretrained(out, max_shard_size="20KB")  # back to shards: a stale model.safetensors would win
    assert "model.safetensors" not in _weight_files(out)
    torch.testing.assert_close(hf_logits(out), first(IDS).logits, atol=1e-5, rtol=1e-5)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".out.")]  # no staging left behind


def test_saved_folder_mode_follows_umask(checkpoint, tmp_path):
    model = om.AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    old = os.umask(0o022)
    try:
        model.save_pretrained(tmp_path / "fresh")
        model.save_pretrained(tmp_path / "fresh")  # replacing keeps the mode too
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) == 0o755


def test_crash_at_the_folder_swap_keeps_the_previous_folder(checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = om.AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    first.save_pretrained(out)
    second = om.AutoModelForCausalLM.from_config(tiny_gpt2_config())

    def crash(*args):
        raise OSError("injected crash at the swap")

    monkeypatch.setattr(atomic, "_exchange", crash)
    with pytest.raises(OSError, match="injected crash at the swap"):
        second.save_pretrained(out)
    torch.testing.assert_close(hf_logits(out), first(IDS).logits, atol=1e-5, rtol=1e-5)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the staging folder is cleaned up

    # Without RENAME_EXCHANGE (other kernels / file systems) two renames run; a crash between them leaves the
    # previous folder aside, and the next save puts it back (with its tokenizer) before replacing it.
    (out / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    real_rename, calls = os.rename, []

    def rename_dies_second_time(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("injected crash between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename_dies_second_time)
    with pytest.raises(OSError, match="between the renames"):
        second.save_pretrained(out)
    monkeypatch.setattr(atomic.os, "rename", real_rename)
    assert not out.exists() and atomic.recover_folder(str(out))
    torch.testing.assert_close(hf_logits(out), first(IDS).logits, atol=1e-5, rtol=1e-5)
    second.save_pretrained(out)
    torch.testing.assert_close(hf_logits(out), second(IDS).logits, atol=1e-5, rtol=1e-5)
    assert (out / "tokenizer.json").exists()
