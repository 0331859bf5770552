"""Packed documents WITH a padding mask under context parallelism attend per document, as every layout without cp
does (``utils.documents.document_ids``): before, the cp mask read documents from ``position_ids`` only when no
padding mask came with them, so a packed batch padded to a fixed length (what a first-fit packer emits) let the
documents of a row see each other at cp 2 only, silently.

One spawned group of 2 gloo processes at cp 2, ring and all-to-all, through ``training.prepare``'s loader (each
sequence split into the cp ranks' chunks with its positions and padding mask, the targets shifted on the whole
sequence first): a native Llama and a generic-path Granite on the padded packed batch of ``test_generic_packed.py``
(4 rows of 12 tokens, 2-3 documents each, restarting ``position_ids``, right padding). The loss and every gradient
equal single-process ``transformers`` on the same documents one per row (fp32, 1e-5). Negative control: the same
batch without its ``position_ids`` (the documents of a row attend to each other) is >1e-4 off the loss.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from tests.generic.test_generic_packed import _config, packed_batch, prepared_whole_batch, reference
from tests.helpers.dist import breadcrumb, run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def _loss_and_model(path, mode, batch):
    """The loss of the whole batch (one backward) through ``training.prepare`` at cp 2, and the model."""
    parallel = om.ParallelConfig(context_parallel_size=2, context_parallel_mode=mode)
    wrapped, model, local = prepared_whole_batch(path, parallel, batch)
    loss = wrapped(**local).loss
    loss.backward()
    logged = loss.detach().clone()
    torch.distributed.all_reduce(logged)  # the logged loss: the world mean of the ranks' terms (as accelerate's)
    return logged / torch.distributed.get_world_size(), model


def _worker(paths, refs):
    ids, pos, mask, labels = packed_batch()
    assert bool((mask == 0).any())  # the batch is padded: the case the cp mask used to get wrong
    for name, path in paths.items():
        ref_loss, ref_grads, _ = refs[name]
        for mode in ("ring", "all_to_all"):
            breadcrumb(f"{name} packed + padding cp2 {mode}")
            loss, model = _loss_and_model(path, mode, dict(input_ids=ids, position_ids=pos, attention_mask=mask,
                                                           labels=labels))
            torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"{name} {mode} loss: {m}", **TOL)
            for key, param in model.named_parameters():
                torch.testing.assert_close(param.grad, ref_grads[key], msg=lambda m, k=key: f"{name} {mode} {k}: {m}",
                                           **TOL)
        breadcrumb(f"{name} negative control: no position_ids")
        leaked, _ = _loss_and_model(path, "ring", dict(input_ids=ids, attention_mask=mask, labels=labels))
        assert (leaked - ref_loss).abs() > 1e-4, (leaked, ref_loss)


@pytest.mark.slow
def test_packed_documents_with_padding_under_context_parallelism(tmp_path):
    torch.manual_seed(0)
    paths = {"llama": str(tmp_path / "llama"), "granite": str(tmp_path / "granite")}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)).save_pretrained(paths["llama"])
    transformers.AutoModelForCausalLM.from_config(_config("granite")).save_pretrained(paths["granite"])
    run_distributed(_worker, 2, paths, {name: reference(path) for name, path in paths.items()}, timeout=900)
