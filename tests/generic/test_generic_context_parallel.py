"""Context parallelism on generic causal LMs through ``transformers``' attention interface: cp 2 x dp 2 trains like
single-process transformers.

One spawned group of 4 gloo processes, through ``training.prepare`` with a plain DataLoader of whole sequences with
unequal label counts (the loader splits them into each cp rank's chunks and shifts the labels on the whole sequence;
the loss is the global batch's):

- granite, ring (ZeRO-3) and cohere2 (sliding window 4 on every other layer, tied embeddings), all-to-all (ZeRO-1);
  2025 types: exaone4 (sliding window, post-norm, QK norm; all-to-all, ZeRO-3), smollm3 (NoPE layers; ring,
  ZeRO-0), olmo3 (sliding window; ring, ZeRO-3), glm4_moe (MoE, partial rotary; all-to-all, ZeRO-3): the logged loss
  of each of 3 AdamW steps and every parameter after them equal single-process ``transformers`` (fp32, 1e-5), every
  layer attending through the registered context-parallel attention;
- negative control: the ring model fed the all-to-all split of the same rows (the chunks it holds are not where it
  puts them) trains away from the reference;
- refused with the reason at load: the hybrids qwen3_next (gated DeltaNet), granitemoehybrid (Mamba-2) and lfm2_moe
  (short convolution), whose first layer does not attend through the interface.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.data.collators.context_parallel import ContextParallelSplitter
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    _collate,
    assert_same_parameters,
    parameters_differ,
    prepared_steps,
    reference_steps,
    sft_rows,
)

CASES = {"granite": ("ring", 3), "cohere2": ("all_to_all", 1), "exaone4": ("all_to_all", 3), "smollm3": ("ring", 0),
         "olmo3": ("ring", 3), "glm4_moe": ("all_to_all", 3)}  # name: (context_parallel_mode, zero stage)
HYBRIDS = ("qwen3_next", "granitemoehybrid", "lfm2_moe")
BATCH = 4


class _SplitAs:
    """A collate function splitting with a given splitter (``training.prepare`` then leaves the batch as it is)."""

    def __init__(self, splitter):
        self.splitter = splitter

    def __call__(self, rows):
        return self.splitter(_collate(rows))


def _load(path, mode):
    parallel = om.ParallelConfig(context_parallel_size=2, data_parallel_size=2, context_parallel_mode=mode)
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel).train()


def _worker(paths):
    import transformers

    rows = sft_rows(101, 48)
    for name, (mode, stage) in CASES.items():
        breadcrumb(name)
        model = _load(paths[name], mode)
        assert model.config._attn_implementation == "oslo_context_parallel"
        model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=stage)
        reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
        reference, expected = reference_steps(reference_class.from_pretrained(paths[name]).train(), rows,
                                              BATCH * model.parallel_context.dp_size)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} {mode} logged losses: {m}")
        assert_same_parameters(model, reference)
        del model
    breadcrumb("negative control")
    model = _load(paths["granite"], "ring")
    context = model.parallel_context
    wrong = _SplitAs(ContextParallelSplitter(context, mode="all_to_all"))
    model, _ = prepared_steps(model, rows, batch=BATCH, zero_stage=3, collate_fn=wrong)
    assert parameters_differ(model, reference_steps(transformers.GraniteForCausalLM.from_pretrained(
        paths["granite"]).train(), rows, BATCH * context.dp_size)[0])
    for name in HYBRIDS:
        with pytest.raises(NotImplementedError, match=r"1 of the 2 layers of \w+ForCausalLM attend through"):
            _load(paths[name], "ring")


@pytest.mark.slow
def test_generic_context_parallel(tmp_path):
    paths = save(tmp_path / "models", (*CASES, *HYBRIDS))
    run_distributed(_worker, 4, paths, timeout=900)
