"""T5 at tp 1/2/4, sequence parallelism off and on, equals plain ``transformers`` for both feed-forwards: ReLU
with the tied, rescaled head (original T5) and gated-GELU with an untied head (T5 v1.1 / Flan-T5). Logits, loss,
every gradient (relative position bias split by heads included) and parameters after 3 AdamW steps, on padded
encoder and decoder batches of unequal lengths."""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import (
    assert_steps_match,
    save_tiny_t5,
    seq2seq_batch,
    single_thread,  # noqa: F401 (a fixture)
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    return save_tiny_t5(root / "relu", gated=False), save_tiny_t5(root / "gated", gated=True)


def _parity_worker(relu_path: str, gated_path: str, tp: int) -> None:
    inputs, labels = seq2seq_batch()
    for path, tied in ((relu_path, True), (gated_path, False)):
        for sp in (False, True):
            parallel = om.ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp)
            reference = transformers.T5ForConditionalGeneration.from_pretrained(path).train()
            model = om.AutoModelForSeq2SeqLM.from_pretrained(path, parallel=parallel, progress=False).train()
            assert isinstance(model, om.T5ForConditionalGeneration)
            assert (model.lm_head.weight is model.shared.weight) is tied
            assert model.config.scale_decoder_outputs is tied
            bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias
            assert bias.weight.shape == (8, 4 // tp)
            assert_steps_match(model, reference, inputs, labels)
    # An encoder length the TP size does not divide runs without SP and still matches.
    odd = dict(input_ids=inputs["input_ids"][:, :7], attention_mask=inputs["attention_mask"][:, :7], labels=labels)
    # atol 2e-5, as assert_steps_match's logits (AVX-512 summation order: 1.2e-5 on 3 of 1212 at tp=4)
    torch.testing.assert_close(model(**odd).logits, reference(**odd).logits, atol=2e-5, rtol=1e-5)


def test_tp1_matches_transformers(checkpoints, single_thread):
    _parity_worker(*checkpoints, 1)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_transformers(checkpoints, tp):
    run_distributed(_parity_worker, tp, *checkpoints, tp)
