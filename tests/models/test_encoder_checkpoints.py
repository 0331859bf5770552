"""Old checkpoints and ``push_to_hub`` for the encoder and encoder-decoder families of issue 27 (ALBERT, DistilBERT,
ELECTRA, DeBERTa-v2, ModernBERT, BART), each on its record's tiny model.

Real checkpoints of these types are often old: a legacy ``pytorch_model.bin`` (a torch pickle of the whole state
dict: tied copies stored twice, BERT-era ``embeddings.position_ids`` buffers) next to a ``config.json`` that lacks
fields ``transformers`` fills in with their defaults. ``from_pretrained`` must load them exactly as ``transformers``
does: the same logits at tp=1 (this process) and tp=2 (two spawned ranks, every family in one group). At tp=2 the
loaded model is then pushed (``push_to_hub``, the Hub replaced by a fake that copies the uploaded folder): the
pushed folder opens in plain ``transformers`` with the same logits.
"""
from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

import oslo_models as om
from oslo_models.models.registry import family_record
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import single_thread  # noqa: F401 (a fixture)
from tests.helpers.fake_hub import CopyingHub
from tests.helpers.zoo import tiny_config

TYPES = ("albert", "distilbert", "electra", "deberta-v2", "modernbert", "bart")
# config.json keys never dropped: what transformers needs to pick the class and the sizes
KEEP = {"model_type", "architectures"}


def _task(model_type: str) -> str:
    return "masked_lm" if "masked_lm" in family_record(model_type).classes else "seq2seq_lm"


def _classes(model_type: str) -> tuple[type, type]:
    om_class = family_record(model_type).model_class(_task(model_type))
    return om_class, om_class.hf_twin


def _save_legacy(model_type: str, folder: str) -> list[str]:
    """The tiny ``transformers`` model as an old checkpoint; returns the config keys it dropped."""
    _, hf_class = _classes(model_type)
    torch.manual_seed(0)
    reference = hf_class(tiny_config(model_type)).eval()
    reference.config.save_pretrained(folder)
    state = reference.state_dict()  # every key, tied copies included, as old transformers pickled them
    base = reference.base_model_prefix
    if model_type != "bart":  # BERT-era checkpoints carry the position-id buffer (transformers ignores it)
        state[f"{base}.embeddings.position_ids"] = torch.arange(tiny_config(model_type).max_position_embeddings)[None]
    torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    # drop the fields transformers fills in with the same value: its default for the type
    path = os.path.join(folder, "config.json")
    with open(path) as file:
        saved = json.load(file)
    defaults = type(reference.config)().to_dict()
    dropped = [key for key, value in saved.items() if key not in KEEP and key in defaults and defaults[key] == value]
    with open(path, "w") as file:
        json.dump({key: value for key, value in saved.items() if key not in dropped}, file)
    return dropped


def _inputs(config) -> dict:
    ids = torch.tensor([[5, 17, 42, 3, 9, 11, 7, 8], [6, 21, 33, 4, 12, 13, 14, 15]]) % config.vocab_size
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    return dict(input_ids=ids.masked_fill(mask == 0, config.pad_token_id), attention_mask=mask)


def _assert_same_logits(model, reference) -> None:
    inputs = _inputs(reference.config)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, reference(**inputs).logits, atol=1e-5, rtol=1e-4)


def _tp2_worker(root: str) -> None:
    """Every family at tp=2: the old checkpoint's logits, then push_to_hub -> plain transformers."""
    for model_type in TYPES:
        folder = os.path.join(root, model_type)
        om_class, hf_class = _classes(model_type)
        model = om_class.from_pretrained(folder, parallel=om.ParallelConfig(tensor_parallel_size=2),
                                         progress=False).eval()
        reference = hf_class.from_pretrained(folder).eval()
        _assert_same_logits(model, reference)
        hub = os.path.join(root, "hub", model_type)
        with mock.patch("huggingface_hub.HfApi", CopyingHub(hub)):
            model.push_to_hub("me/tiny")
        torch.distributed.barrier()  # (the process group exists once the first model is built)
        if torch.distributed.get_rank() == 0:  # what the Hub received: plain transformers, same keys and logits
            pushed = hf_class.from_pretrained(os.path.join(hub, "me--tiny")).eval()
            assert set(pushed.state_dict()) == set(reference.state_dict()), model_type
            _assert_same_logits(pushed, reference)


@pytest.mark.parametrize("model_type", TYPES)
def test_legacy_checkpoint_loads_as_transformers(model_type, tmp_path, single_thread):
    """tp=1: the ``.bin`` checkpoint with a config lacking defaulted fields gives transformers' logits."""
    folder = str(tmp_path / model_type)
    dropped = _save_legacy(model_type, folder)
    assert dropped and not os.path.exists(os.path.join(folder, "model.safetensors"))
    om_class, hf_class = _classes(model_type)
    reference = hf_class.from_pretrained(folder).eval()
    model = om_class.from_pretrained(folder, progress=False).eval()
    for key in dropped:  # filled in alike
        assert getattr(model.config, key) == getattr(reference.config, key), key
    _assert_same_logits(model, reference)


def test_legacy_checkpoints_under_tp_and_push_to_hub(tmp_path):
    for model_type in TYPES:
        _save_legacy(model_type, str(tmp_path / model_type))
    run_distributed(_tp2_worker, 2, str(tmp_path))
