"""``ParallelConfig(tiled_loss=True)`` under pipeline parallelism (issue 52): the last stage sends its final hidden
states to the schedule's loss, which runs the LM head and the cross-entropy fused in row chunks (no ``[mb, s, V/tp]``
logits). One world of 4 gloo processes:

- Llama (untied) at pp 2 x dp 2 (1F1B, 2 microbatches per replica) through ``training.prepare`` at ZeRO-1 and ZeRO-3,
  and Qwen2 (embeddings tied across the stages) at pp 2 x tp 2 + SP (a vocab-parallel head), on SFT rows whose label
  counts differ (prompts masked, right padding, a row with no label): the logged loss of 3 AdamW steps and every
  parameter after them equal single-process ``transformers`` on the global batch (fp32, 1e-5); then ``eval_step``'s
  loss equals ``transformers``'.
- Bytes: one ``train_step`` of Llama (vocab 2000) at pp 2 x dp 2 keeps no logits-sized tensor for the backward on the
  last stage with the option, and at least one ``[mb, s, V]`` fp32 tensor per microbatch without it (the control).
- Negative control: the tiled head with each microbatch's own token mean instead of its share of the global batch's
  label count trains away from ``transformers``.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.models.common.loss.lm_loss import head_loss_and_logits
from tests.helpers.decoders import save_tiny
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    assert_same_parameters,
    parameters_differ,
    prepared_steps,
    reference_steps,
    sft_rows,
)

BATCH = 4  # rows per replica and step (2 per microbatch)
PP_DP = dict(pipeline_parallel_size=2, num_microbatches=2, data_parallel_size=2, tiled_loss=True)
PP_TP = dict(pipeline_parallel_size=2, num_microbatches=2, tensor_parallel_size=2, sequence_parallel=True,
             tiled_loss=True)


def _train(path, layout, zero_stage, rows, broken: bool = False):
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**layout)).train()
    runner = model._pipeline_runner()
    assert runner.adapter.tiles_loss(model)
    if broken:  # the negative control: each microbatch's own token mean
        runner.loss_fn.adapter = _OwnMean()
    dp = model.parallel_context.dp_size
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=zero_stage)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    reference, expected = reference_steps(reference, rows, BATCH * dp)
    return model, reference, logged, expected


class _OwnMean:
    """A broken tiled loss: the head and the cross-entropy in chunks, divided by the microbatch's own label count."""

    def microbatch_loss(self, model, hidden, labels, num_items_in_batch, num_microbatches):
        return head_loss_and_logits(model.lm_head, hidden, labels, causal=True, skip_logits=True)[0]


class _LogitsSized(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the saved-for-backward tensors shaped like logits: a last dim of at least ``vocab`` and at least
    ``numel`` elements (the head's weight ``[V, h]``, which the fused loss saves, is not one)."""

    def __init__(self, vocab: int, numel: int):
        self.bytes = 0

        def pack(tensor):
            if tensor.dim() and tensor.shape[-1] >= vocab and tensor.numel() >= numel:
                self.bytes += tensor.numel() * tensor.element_size()
            return tensor

        super().__init__(pack, lambda t: t)


def _logits_bytes(path, tiled: bool) -> tuple[int, int]:
    """``(bytes of logits-sized saved tensors on this rank in one train_step, one microbatch's logits bytes)``."""
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(
        **{**PP_DP, "tiled_loss": tiled})).train()
    rows = sft_rows(2000, 2 * BATCH)
    context = model.parallel_context
    mine = rows[context.dp_rank * BATCH:(context.dp_rank + 1) * BATCH]
    batch = {key: torch.stack([row[key] for row in mine]) for key in mine[0]}
    mb, seq = BATCH // 2, batch["input_ids"].shape[1]
    hooks = _LogitsSized(2000, mb * seq * 2000)
    with hooks:
        loss = model.train_step(batch)
    assert torch.isfinite(loss)
    return (hooks.bytes if model.pipeline_layout.has_last else -1), mb * seq * 2000 * 4


def _eval_matches(model, reference, rows):
    """``eval_step`` (the tiled head in the schedule's forward only) on this replica's rows of the first global
    batch equals ``transformers``' loss of that batch."""
    context = model.parallel_context
    dp = context.dp_size
    mine = rows[context.dp_rank * BATCH:(context.dp_rank + 1) * BATCH]
    local = {key: torch.stack([row[key] for row in mine]) for key in mine[0]}
    whole = {key: torch.stack([row[key] for row in rows[:BATCH * dp]]) for key in rows[0]}
    with torch.no_grad():
        expected = reference(**whole).loss
    torch.testing.assert_close(model.eval_step(local), expected, atol=1e-5, rtol=1e-5)


def _world(paths):
    rows = sft_rows(101, 48)
    for name, layout, zero_stage in (("llama", PP_DP, 1), ("llama", PP_DP, 3), ("qwen2", PP_TP, 0)):
        breadcrumb(f"{name} {layout} zero{zero_stage}")
        model, reference, logged, expected = _train(paths[name], layout, zero_stage, rows)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} zero{zero_stage} logged losses: {m}")
        assert_same_parameters(model, reference)
        _eval_matches(model, reference, rows)
        del model, reference
    breadcrumb("negative control: each microbatch's own mean")
    model, reference, _, _ = _train(paths["llama"], PP_DP, 1, rows, broken=True)
    assert parameters_differ(model, reference), "the per-microbatch mean matched the global batch's"
    breadcrumb("bytes")
    plain, logits = _logits_bytes(paths["wide"], tiled=False)
    tiled, _ = _logits_bytes(paths["wide"], tiled=True)
    if plain >= 0:  # the last stage
        assert plain >= 2 * logits, (plain, logits)  # the control: each microbatch's [mb, s, V] fp32 kept
        assert tiled == 0, tiled


@pytest.mark.slow
def test_tiled_loss_under_pipeline_parallelism(tmp_path):
    paths = {"llama": save_tiny(tmp_path / "llama", "llama"), "qwen2": save_tiny(tmp_path / "qwen2", "qwen2"),
             "wide": save_tiny(tmp_path / "wide", "llama", vocab_size=2000)}
    run_distributed(_world, 4, paths, timeout=1200)
