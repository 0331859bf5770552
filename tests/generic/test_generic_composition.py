"""The generic path's axes together: tp 2 + SP x cp 2 (ring) x dp 2 ZeRO-3 on 8 processes trains like transformers.

One spawned group of 8 gloo processes, granite (a dense decoder with a plan) through ``training.prepare`` with a plain
DataLoader of whole sequences with unequal label counts: the loader splits each sequence into the cp ranks' chunks,
the layers run on half of each chunk (SP), the sequence is gathered per region over tp, the chunks attend across cp
through the registered attention function, the head's logits stay split by vocabulary, and FSDP2 shards everything
over dp x cp. The logged loss of each of 3 AdamW steps and every parameter after them equal single-process
``transformers`` on the global batch (fp32, 1e-5). Negative control: the per-replica mean
(``average_tokens_across_devices=False``) trains away from it.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    assert_same_parameters,
    parameters_differ,
    prepared_steps,
    reference_steps,
    sft_rows,
)

BATCH = 4


def _worker(path):
    import transformers

    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                                 data_parallel_size=2)
    rows = sft_rows(101, 24)
    for average in (True, False):
        breadcrumb(f"average={average}")
        model = om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel).train()
        assert model._oslo_vocab_parallel_loss and model._oslo_sequence_parallel
        assert model.config._attn_implementation == "oslo_context_parallel"
        model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=3, average=average)
        reference, expected = reference_steps(transformers.GraniteForCausalLM.from_pretrained(path).train(), rows,
                                              BATCH * 2)
        if average:
            torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5)
            assert_same_parameters(model, reference)
        else:
            assert parameters_differ(model, reference)
        del model, reference


@pytest.mark.slow
def test_generic_tp_sp_cp_dp_zero3_on_eight_ranks(tmp_path):
    path = save(tmp_path / "models", ["granite"])["granite"]
    run_distributed(_worker, 8, path, timeout=900)
