"""Gemma 2's attention logit soft-capping under context parallelism (a refusal lifted, issue 52): the ring and the
all-to-all cores cap the scores inside each block (``c * tanh(s / c)`` before the mask; the ring's backward through
``1 - tanh^2``), so 3 AdamW steps at cp 2 give the losses and the parameters of ``transformers``.

One spawned world of 2 gloo processes: Gemma 2's tiny record (cap 0.5, which caps at its initializer range;
sliding window 3 on alternate layers; the final logit cap), padded rows of 12 tokens, ring then all-to-all.
The chunks' gradients are averaged over cp as data parallelism over dp x cp does. Negative control: the same model
with the cap taken off its attention modules (library code running Gemma 2 without it) is off at the first step.
"""
from __future__ import annotations

import oslo_models as om
from oslo_models.data import ContextParallelSplitter
from tests.helpers.cp_steps import assert_run_matches, cp_run, reference_run
from tests.helpers.decoders import hf_class, save_tiny
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import padded_batch

STEPS = 3


def _batches():
    return [padded_batch(101, batch=2, seq=12, seed=seed) for seed in range(STEPS)]


def reference(path):
    model = hf_class("gemma2").from_pretrained(path, attn_implementation="eager").train()
    return reference_run(model, (dict(input_ids=ids, attention_mask=mask, labels=labels)
                                 for ids, mask, labels in _batches()))


def _train(path, mode, steps, *, cap=True):
    model = om.AutoModelForCausalLM.from_pretrained(path, progress=False, parallel=om.ParallelConfig(
        context_parallel_size=2, context_parallel_mode=mode)).train()
    if not cap:
        for layer in model.model.layers:
            layer.self_attn.softcap = None
    om.distributed.mark_gradients_reduced(model, "caller")  # the chunks' gradients are averaged in cp_run
    split = ContextParallelSplitter(model.parallel_context, shift_labels=True)
    return model, cp_run(model, (split(dict(input_ids=ids, attention_mask=mask, labels=labels))
                                 for ids, mask, labels in _batches()[:steps]))


def _worker(path, ref_losses, ref_params):
    for mode in ("ring", "all_to_all"):
        breadcrumb(mode)
        model, losses = _train(path, mode, STEPS)
        assert_run_matches(mode, model, losses, ref_losses, ref_params)
        _, uncapped = _train(path, mode, 1, cap=False)
        assert (uncapped[0] - ref_losses[0]).abs() > 1e-4, (mode, uncapped[0], ref_losses[0])


def test_gemma2_softcap_trains_at_cp2(tmp_path):
    path = save_tiny(tmp_path / "gemma2", "gemma2")
    losses, params = reference(path)
    run_distributed(_worker, 2, path, losses, params, timeout=900)
