"""Pipeline parallelism with sequence and context parallelism on generic causal LMs (issue 50): trains like
single-process ``transformers``.

One spawned group of 4 gloo processes, through ``training.prepare`` and ``model.train_step`` (1F1B, two microbatches
per replica) with a plain DataLoader of SFT rows whose label counts differ (prompt masks, right padding, a row with no
label; the loss is the global batch's):

- pp 2 x tp 2 + SP: granite (dense regions) and glm4_moe (an MoE region: router on the gathered sequence, the
  experts split over tp); the stages exchange the sequence slices ``[mb, s/tp, h]`` (the first stage cuts at the
  model's first layer, the last gathers after its last);
- pp 2 x cp 2: granite (ring) and cohere2 (all-to-all; sliding window, tied embeddings): each stage builds the
  context-parallel mask of its chunk and attends across the cp group; the loss is the chunks' shares summed over cp;
- each: the logged loss of each of 3 AdamW steps and every parameter after them equal ``transformers`` (fp32, 1e-5);
- negative controls: SP without the norms' gradient sums over tp (granite: the norms drift), cp with the chunks
  attending only within themselves (granite: sdpa instead of the cp attention; the first loss is off).

Pipeline x expert parallelism and the load-balancing loss: ``test_generic_pipeline_experts.py``.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from tests.generic.models import save
from tests.generic.test_generic_tp_exactness import _remove_fixes
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    assert_same_parameters,
    parameters_differ,
    prepared_steps,
    reference_steps,
    sft_rows,
)

BATCH = 4  # rows per replica and step: 2 microbatches of 2
PP = dict(pipeline_parallel_size=2, num_microbatches=2)
SP = dict(PP, tensor_parallel_size=2, sequence_parallel=True)
CP = dict(PP, context_parallel_size=2)
LAYOUTS = [  # (name, layout, zero stage)
    ("granite", SP, 0),
    ("glm4_moe", SP, 0),
    ("granite", CP, 0),
    ("cohere2", dict(CP, context_parallel_mode="all_to_all"), 0),
]
NEGATIVE = {"sp": ("granite", SP), "cp": ("granite", CP)}


def _break(model, what: str) -> None:
    if what == "sp":  # the norms' partial gradients (each tp rank's tokens) left unsummed
        assert _remove_fixes(model)
    else:  # each chunk attends within itself only
        model.set_attn_implementation("sdpa")


def _train(name, path, layout, zero_stage, rows, broken=None):
    import transformers

    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**layout)).train()
    context = model.parallel_context
    if broken:
        _break(model, broken)
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=zero_stage)
    reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
    reference, expected = reference_steps(reference_class.from_pretrained(path).train(), rows, BATCH * context.dp_size)
    return model, reference, logged, expected


def _worker(paths):
    rows = sft_rows(101, 48)
    for name, layout, zero_stage in LAYOUTS:
        breadcrumb(f"{name} {layout} zero{zero_stage}")
        model, reference, logged, expected = _train(name, paths[name], layout, zero_stage, rows)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} {layout} logged losses: {m}")
        assert_same_parameters(model, reference)
        del model, reference
    for what, (name, layout) in NEGATIVE.items():
        breadcrumb(f"negative control {what}: {name}")
        model, reference, logged, expected = _train(name, paths[name], layout, 0, rows, broken=what)
        if what == "cp":
            assert abs(logged[0] - expected[0]) > 1e-4, (logged, expected)
        assert parameters_differ(model, reference), f"{what}: the broken {name} matched transformers"
        del model, reference


@pytest.mark.slow
def test_generic_pipeline_with_sequence_and_context_parallel(tmp_path):
    paths = save(tmp_path / "models", ["granite", "glm4_moe", "cohere2"])
    run_distributed(_worker, 4, paths, timeout=900)
