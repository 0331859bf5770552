"""Packed documents on a pipelined generic causal LM under context parallelism attend per document (issue 50).

One spawned group of 4 gloo processes at pp 2 x cp 2 (1F1B, two microbatches), ring and all-to-all: granite with the
packed global batch of ``test_generic_packed.py`` (4 rows of 12 tokens, 2-3 documents each, restarting
``position_ids``, no padding mask) through ``training.prepare``'s loader (each sequence split into the cp ranks'
chunks with its positions, the targets shifted on the whole sequence first) and ``model.train_step``: each stage
builds the context-parallel mask of its chunk from the documents of the global positions. The loss and every
gradient equal single-process ``transformers`` on the same documents one per row (fp32, 1e-5). Negative control: the
same batch without its ``position_ids`` (the documents of a row attend to each other) is >1e-4 off the loss. The
same packed rows with their right-padding mask (ring) equal the reference too (the cp mask reads the documents from
the positions and the padding together; with documents read only without a padding mask: 1.2e-3 off the loss).
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from tests.generic.test_generic_packed import _config, packed_batch, prepared_whole_batch, reference
from tests.helpers.dist import breadcrumb, run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def _step(path, mode, batch):
    """One ``train_step`` (SGD at lr 0) of the whole batch through ``training.prepare``; the loss and the model."""
    parallel = om.ParallelConfig(pipeline_parallel_size=2, context_parallel_size=2, num_microbatches=2,
                                 context_parallel_mode=mode)
    wrapped, model, local = prepared_whole_batch(path, parallel, batch)
    return wrapped.train_step(local), model


def _worker(path, ref):
    ref_loss, ref_grads, _ = ref
    ids, pos, mask, labels = packed_batch()
    for mode in ("ring", "all_to_all"):
        breadcrumb(f"granite packed pp2 x cp2 {mode}")
        loss, model = _step(path, mode, dict(input_ids=ids, position_ids=pos, labels=labels))
        torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"{mode} loss: {m}", **TOL)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, ref_grads[name], msg=lambda m, n=name: f"{mode} {n}: {m}", **TOL)
    breadcrumb("granite packed + padding mask pp2 x cp2 ring")  # the documents from positions and padding together
    loss, model = _step(path, "ring", dict(input_ids=ids, position_ids=pos, attention_mask=mask, labels=labels))
    torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"padded loss: {m}", **TOL)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], msg=lambda m, n=name: f"padded {n}: {m}", **TOL)
    breadcrumb("negative control: no position_ids")
    leaked, _ = _step(path, "ring", dict(input_ids=ids, labels=labels))
    assert (leaked - ref_loss).abs() > 1e-4, (leaked, ref_loss)


@pytest.mark.slow
def test_generic_pipeline_context_parallel_packed(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "granite")
    transformers.AutoModelForCausalLM.from_config(_config("granite")).save_pretrained(path)
    run_distributed(_worker, 4, path, reference(path), timeout=900)
