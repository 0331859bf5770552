"""RoBERTa (position ids from ``padding_idx``, ``lm_head`` with a tied bias) at tp 1/2/4, sequence parallelism off
and on, equals plain ``transformers``: logits, loss, every gradient, parameters after 3 AdamW steps."""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import assert_steps_match, mlm_batch, save_tiny, tiny_bert_config
from tests.helpers.encoders import single_thread  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("roberta"), transformers.RobertaForMaskedLM,
                     tiny_bert_config(transformers.RobertaConfig, max_position_embeddings=16))


def _parity_worker(path: str, tp: int) -> None:
    inputs, labels = mlm_batch(pad_token_id=1)
    for sp in (False, True):
        parallel = om.ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp)
        reference = transformers.RobertaForMaskedLM.from_pretrained(path).train()
        model = om.AutoModelForMaskedLM.from_pretrained(path, parallel=parallel, progress=False).train()
        assert isinstance(model, om.RobertaForMaskedLM)
        assert model.lm_head.decoder.bias is model.lm_head.bias
        assert_steps_match(model, reference, inputs, labels)


def test_tp1_matches_transformers(checkpoint, single_thread):
    _parity_worker(checkpoint, 1)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_transformers(checkpoint, tp):
    run_distributed(_parity_worker, tp, checkpoint, tp)


@pytest.mark.parametrize("kind", ["sequence", "token", "qa"])
def test_heads_match_transformers(tmp_path, kind, single_thread):
    """The replicated heads (on the encoder tested above): one step of logits, loss and gradients."""
    hf_class, auto, label_kwargs = {
        "sequence": (transformers.RobertaForSequenceClassification, om.AutoModelForSequenceClassification,
                     dict(labels=torch.tensor([0, 2, 1]))),
        "token": (transformers.RobertaForTokenClassification, om.AutoModelForTokenClassification,
                  dict(labels=torch.tensor([[0, 2, 1, -100, 1, 0, 2, 2]] * 3))),
        "qa": (transformers.RobertaForQuestionAnswering, om.AutoModelForQuestionAnswering,
               dict(start_positions=torch.tensor([1, 0, 9]), end_positions=torch.tensor([3, 2, 5]))),
    }[kind]
    config = tiny_bert_config(transformers.RobertaConfig, num_labels=2 if kind == "qa" else 3)
    path = save_tiny(tmp_path, hf_class, config)
    inputs, _ = mlm_batch(pad_token_id=1)
    reference = hf_class.from_pretrained(path).train()
    model = auto.from_pretrained(path, progress=False).train()
    assert type(model).__name__ == hf_class.__name__
    labels = label_kwargs.pop("labels", None)
    assert_steps_match(model, reference, inputs, labels, steps=1,
                       logits_key="start_logits" if kind == "qa" else "logits", **label_kwargs)
