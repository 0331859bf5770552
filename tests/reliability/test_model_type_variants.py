"""mT5, XLM-RoBERTa and CamemBERT checkpoints load through the T5 / RoBERTa classes with their own config class,
equal plain ``transformers`` (logits and loss at tp=2), and save with their own ``model_type`` and
``architectures`` so that plain ``transformers`` loads them back as what they were (same logits). The mT5
checkpoint has its own ``lm_head`` (as the Hub's mT5 checkpoints) and no output rescale."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import oslo_models as om
from tests.helpers import zoo
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import VOCAB, save_tiny

CASES = {  # model_type -> (transformers class, oslo auto class, oslo class name)
    "xlm-roberta": (transformers.XLMRobertaForMaskedLM, om.AutoModelForMaskedLM, "XLMRobertaForMaskedLM"),
    "camembert": (transformers.CamembertForSequenceClassification, om.AutoModelForSequenceClassification,
                  "CamembertForSequenceClassification"),
    "mt5": (transformers.MT5ForConditionalGeneration, om.AutoModelForSeq2SeqLM, "MT5ForConditionalGeneration"),
}


def _inputs(model_type: str) -> dict:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 8), generator=gen)
    if model_type == "mt5":
        return dict(input_ids=ids, labels=torch.randint(3, VOCAB, (2, 4), generator=gen))
    if model_type == "camembert":
        return dict(input_ids=ids, labels=torch.tensor([0, 1]))
    return dict(input_ids=ids, labels=ids)


def _assert_same_outputs(model, reference, model_type: str) -> None:
    inputs = _inputs(model_type)
    with torch.no_grad():
        got, want = model(**inputs), reference(**inputs)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)


def _worker(paths: dict[str, str], out_root: str) -> None:
    for model_type, path in paths.items():
        hf_cls, auto, name = CASES[model_type]
        reference = hf_cls.from_pretrained(path).eval()
        model = auto.from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=2), progress=False)
        assert type(model).__name__ == name and type(model.config).model_type == model_type
        assert isinstance(model.config, type(reference.config))  # its own config class (a subclass of it)
        _assert_same_outputs(model, reference, model_type)
        out = os.path.join(out_root, model_type)
        model.save_pretrained(out)
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(out, "config.json")) as handle:
                saved = json.load(handle)
            assert saved["model_type"] == model_type and saved["architectures"] == [name]
            reloaded = getattr(transformers, name).from_pretrained(out).eval()
            auto_loaded = transformers.AutoConfig.from_pretrained(out)
            assert type(auto_loaded) is type(reference.config)
            _assert_same_outputs(reloaded, reference, model_type)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    # the zoo's tiny models (RoBERTa's special tokens; mT5's gated-GELU feed-forward and untied head)
    xlmr = save_tiny(root / "xlm-roberta", transformers.XLMRobertaForMaskedLM, zoo.tiny_config("xlm-roberta"))
    camembert = save_tiny(root / "camembert", transformers.CamembertForSequenceClassification,
                          zoo.tiny_config("camembert", num_labels=2))
    mt5 = save_tiny(root / "mt5", transformers.MT5ForConditionalGeneration, zoo.tiny_config("mt5"))
    file = os.path.join(mt5, "model.safetensors")
    state = load_file(file)  # the Hub's mT5 checkpoints carry their own lm_head
    state["lm_head.weight"] = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(1))
    save_file(state, file, metadata={"format": "pt"})
    return {"xlm-roberta": xlmr, "camembert": camembert, "mt5": mt5}


def test_variants_load_save_round_trip_at_tp2(checkpoints, tmp_path):
    run_distributed(_worker, 2, checkpoints, str(tmp_path), timeout=180)


def test_from_config_matches_transformers_init(checkpoints):
    """``from_config`` with the variant's config draws the twin's weights (same seed, same values)."""
    config = transformers.AutoConfig.from_pretrained(checkpoints["xlm-roberta"])
    torch.manual_seed(0)
    model = om.AutoModelForMaskedLM.from_config(config)
    assert type(model).__name__ == "XLMRobertaForMaskedLM"
    torch.manual_seed(0)
    reference = transformers.XLMRobertaForMaskedLM(config).eval()
    _assert_same_outputs(model.eval(), reference, "xlm-roberta")
