"""The generic path's axes together on 8 processes train like transformers: four axes per layout.

One spawned group of 8 gloo processes, through ``training.prepare`` with a plain DataLoader of whole sequences with
unequal label counts (the loss is the global batch's):

- granite (a dense decoder with a plan) at tp 2 + SP x cp 2 (ring) x dp 2 ZeRO-3: the loader splits each sequence
  into the cp ranks' chunks, the layers run on half of each chunk (SP), the sequence is gathered per region over tp,
  the chunks attend across cp through the registered attention function, the head's logits stay split by
  vocabulary, and FSDP2 shards everything over dp x cp;
- glm4_moe (2025, MoE with shared experts and a dense first layer) at tp 2 + SP x cp 2 (all-to-all) x dp 2 ZeRO-3,
  its experts split over tp (the MoE region: router on the gathered sequence, the output cut to the slice);
- glm4_moe at tp 2 + SP x dp 4 ZeRO-3 with ep 2 inside dp (two ep groups of 2 per tp rank, each expert on the 2 ranks
  of its edp group, FSDP2 units of the experts over edp);
- glm4_moe at tp 2 + SP x cp 2 (ring) x dp 2 ZeRO-3 with ep 2 inside dp x cp (the experts leave the tp plan; each ep
  group is the two cp ranks of a replica's tp rank, each expert on the 2 dp ranks of its edp group);
- each: the logged loss of each of 3 AdamW steps and every parameter after them equal single-process
  ``transformers`` on the global batch (fp32, 1e-5). Negative control (each layout): the per-replica mean
  (``average_tokens_across_devices=False``) trains away from it.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.generic.install_state import generic_install
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
TP_SP = dict(tensor_parallel_size=2, sequence_parallel=True)
LAYOUTS = [  # (name, layout)
    ("granite", dict(TP_SP, context_parallel_size=2, data_parallel_size=2)),
    ("glm4_moe", dict(TP_SP, context_parallel_size=2, data_parallel_size=2, context_parallel_mode="all_to_all")),
    ("glm4_moe", dict(TP_SP, data_parallel_size=4, expert_parallel_size=2)),
    ("glm4_moe", dict(TP_SP, context_parallel_size=2, data_parallel_size=2, expert_parallel_size=2)),
]


def _worker(paths):
    import transformers

    rows = sft_rows(101, 48)
    for name, layout in LAYOUTS:
        for average in (True, False):
            breadcrumb(f"{name} {layout} average={average}")
            model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=om.ParallelConfig(**layout)).train()
            assert generic_install(model).vocab_parallel_loss and generic_install(model).sequence_parallel
            context = model.parallel_context
            if context.cp_size > 1:
                assert model.config._attn_implementation == "oslo_context_parallel"
            model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=3, average=average)
            reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
            reference, expected = reference_steps(reference_class.from_pretrained(paths[name]).train(), rows,
                                                  BATCH * context.dp_size)
            if average:
                torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{name} {layout} logged losses: {m}")
                assert_same_parameters(model, reference)
            else:
                assert parameters_differ(model, reference)
            del model, reference


@pytest.mark.slow
def test_generic_four_axes_on_eight_ranks(tmp_path):
    paths = save(tmp_path / "models", ["granite", "glm4_moe"])
    run_distributed(_worker, 8, paths, timeout=1500)
