"""Generic causal LMs train on the vocabulary-parallel loss: no tp rank holds a training step's full-vocabulary logits.

One spawned group of 4 gloo processes, tp 2 x dp 2 ZeRO-3 through ``training.prepare`` with a plain DataLoader of
rows with unequal label counts (prompts and padding masked, one row with no label; the loss is the global batch's):

- granite (untied head, vocabulary 101: tp slices of 51 and 50 columns) and cohere (head tied to the vocab-split
  embedding, logit scale): the logged loss of each of 3 AdamW steps and every parameter after them equal
  single-process ``transformers`` on the global batch (fp32, 1e-5);
- with labels the forward returns this rank's vocabulary slice (51 / 50 columns), without labels the whole
  vocabulary, equal to ``transformers``' logits;
- negative control: the same loss function told that every rank's slice starts at id 0 (the split misread) is not
  the model's loss;
- ``from_config`` at tp 2 keeps cohere's tied head tied (it raised ``KeyError: 'lm_head.weight'`` before).
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.generic.install_state import generic_install
from oslo_models.generic.vocab_parallel_loss import VocabParallelCausalLMLoss
from tests.generic.models import CONFIGS, save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    _collate,
    assert_same_parameters,
    prepared_steps,
    reference_steps,
    sft_rows,
)

CASES = ("granite", "cohere")
BATCH = 4


def _worker(paths):
    import transformers

    for name in CASES:
        breadcrumb(name)
        parallel = om.ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
        model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=parallel).train()
        context = model.parallel_context
        assert generic_install(model).vocab_parallel_loss
        rows = sft_rows(101, 48)
        model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=3)
        reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
        reference, expected = reference_steps(reference_class.from_pretrained(paths[name]).train(), rows,
                                              BATCH * context.dp_size)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} logged losses: {m}")
        assert_same_parameters(model, reference)

        batch = _collate(rows[:2])
        output = model(**batch)
        assert output.logits.shape[-1] == (51, 50)[context.tp_rank], output.logits.shape
        with torch.no_grad():
            whole = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            expected_logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        torch.testing.assert_close(whole, expected_logits, atol=2e-5, rtol=1e-5)
        wrong_split = VocabParallelCausalLMLoss(context.tp_group, vocab_start=0)(output.logits, batch["labels"])
        assert not torch.allclose(wrong_split, output.loss, atol=1e-3), (wrong_split, output.loss)
        torch.testing.assert_close(output.loss, reference(**batch).loss, atol=1e-5, rtol=1e-5)
        del model, reference
    # from_config at tp keeps a tied head tied (its plan's lm_head.weight entry names the embedding's tensor)
    torch.manual_seed(0)
    tied = om.AutoModelForCausalLM.from_config(CONFIGS["cohere"](), parallel=om.ParallelConfig(tensor_parallel_size=2,
                                                                                              data_parallel_size=2))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.slow
def test_generic_vocab_parallel_loss(tmp_path):
    paths = save(tmp_path / "models", CASES)
    run_distributed(_worker, 4, paths, timeout=900)
