"""The example scripts take any model type: ``--model-type`` builds a small one of any type, a layout its path
refuses is one clean ``UsageError`` before anything starts, and a generic type trains end to end."""
from __future__ import annotations

import json
import sys

import pytest
import transformers

import oslo_models as om
from tests.helpers import examples as helpers


@pytest.fixture(scope="module")
def examples():
    import importlib

    sys.path.insert(0, helpers.EXAMPLES)
    try:
        yield {name: importlib.import_module(name) for name in ("_common", "train_clm", "train_mlm")}
    finally:
        sys.path.remove(helpers.EXAMPLES)


def test_model_type_and_launch_checks(examples, monkeypatch):
    common, parse = examples["_common"], examples["train_clm"].parse_args
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = common.small_config(parse(["--model-type", "mamba", "--n-embd", "32", "--n-layer", "3"]), 57)
    assert type(config) is transformers.MambaConfig and (config.hidden_size, config.num_hidden_layers) == (32, 3)
    assert common.small_config(parse(["--model-type", "gpt2", "--n-embd", "32"]), 57).n_embd == 32  # mapped name
    cases = {
        ("--model-type", "mamba", "--tp", "2"): "'mamba' has no native family .* runs data parallel only",
        ("--model-type", "mamba", "--sequence-parallel"): "sequence parallelism splits the sequence between the",
        ("--model-type", "no-such-type"): "--model-type 'no-such-type'",
        ("--model-type", "vit"): "Unsupported model type 'vit'",
        ("--model-type", "llama", "--tp", "2", "--n-head", "3", "--n-embd", "96"): "heads=3 is not divisible",
        ("--model-type", "llama", "--n-head", "3"): "not a multiple of the number of attention heads",
        ("--model-type", "mamba", "--model", "x"): "not both",
    }
    for argv, message in cases.items():
        with pytest.raises(common.UsageError, match=message):
            common.check_launch(parse(list(argv)), om.AutoModelForCausalLM)
    assert common.check_launch(parse(["--model-type", "granite", "--tp", "2", "--zero", "3"]),
                               om.AutoModelForCausalLM).tensor_parallel_size == 2
    with pytest.raises(common.UsageError, match="'mamba'.*no AutoModelForMaskedLM class"):
        common.check_launch(examples["train_mlm"].parse_args(["--model-type", "mamba"]), om.AutoModelForMaskedLM)


def test_generic_type_trains_through_the_example(tmp_path):
    out = tmp_path / "out"
    helpers.launch([sys.executable], "train_clm.py", "--model-type", "mamba", "--steps", "2", "--output", str(out),
                   "--mixed-precision", "bf16", *helpers.TINY)  # Accelerate's autocast around transformers' model
    report = json.loads((out / "loss.json").read_text())
    assert len(report["losses"]) == 2 and all(4.0 < loss < 7.0 for loss in report["losses"])  # ln(vocab) ~ 6
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "model")  # the Hub folder, plain transformers
    assert type(plain) is transformers.MambaForCausalLM and plain.config.hidden_size == 64
