"""BERT at tp 4, sequence parallelism off and on, equals plain ``transformers``: logits, loss, every gradient and
the parameters after 3 AdamW steps, for the MLM head (tied vocab-parallel decoder with its own bias) and the
sequence-classification head, on padded batches of unequal lengths with token types. (tp 1, tp 2 with and without
sequence parallelism, the other heads, save -> load and the other layouts: the encoder zoo,
``test_encoder_zoo.py``.)"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import VOCAB, assert_steps_match, mlm_batch, save_tiny, tiny_bert_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    return (save_tiny(root / "mlm", transformers.BertForMaskedLM, tiny_bert_config()),
            save_tiny(root / "cls", transformers.BertForSequenceClassification, tiny_bert_config(num_labels=3)))


def _parity_worker(mlm_path: str, cls_path: str, tp: int) -> None:
    inputs, labels = mlm_batch()
    for sp in (False, True):
        parallel = om.ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp)
        reference = transformers.BertForMaskedLM.from_pretrained(mlm_path).train()
        model = om.AutoModelForMaskedLM.from_pretrained(mlm_path, parallel=parallel, progress=False).train()
        assert isinstance(model, om.BertForMaskedLM) and model.parallel_context.tp_size == tp
        decoder = model.cls.predictions.decoder
        assert decoder.weight is model.bert.embeddings.word_embeddings.weight
        assert decoder.bias is model.cls.predictions.bias and decoder.bias.shape[0] == -(-VOCAB // tp)
        assert_steps_match(model, reference, inputs, labels)
        odd = {key: value[:, :7] for key, value in inputs.items()}  # SP does not divide: runs without it
        torch.testing.assert_close(model(**odd).logits, reference(**odd).logits, atol=1e-5, rtol=1e-5)

        reference = transformers.BertForSequenceClassification.from_pretrained(cls_path).train()
        model = om.AutoModelForSequenceClassification.from_pretrained(cls_path, parallel=parallel,
                                                                      progress=False).train()
        assert isinstance(model, om.BertForSequenceClassification)
        assert_steps_match(model, reference, inputs, torch.tensor([0, 2, 1]))


def test_tensor_parallel_matches_transformers(checkpoints):
    run_distributed(_parity_worker, 4, *checkpoints, 4)
