"""A generic model's vocabulary-split embedding keeps only its rows' gradient on each tp rank
(``oslo_models/generic/vocab_embedding.py``).

One spawned group of 4 gloo processes, granite (untied embedding, vocabulary 101 split 51 / 50 over tp 2, hidden 64)
at tp 2 x dp 2:

- memory: after one backward the embedding weight's gradient is a ``Shard(0)`` DTensor whose local tensor is this
  rank's ``[51 | 50, 64]`` rows (13056 / 12800 bytes), its values the same rows of the whole gradient; negative
  control: with the hook taken off the gradient is the whole ``[101, 64]`` (25856 bytes) on every rank, as before
  the fix - the bytes assertion would fail;
- exactness: through ``training.prepare`` at ZeRO-0 (gradient accumulation 2: the slices accumulate) and ZeRO-1
  (the DTensor ``ShardedStateOptimizer``), the logged loss of each of 3 AdamW steps on rows with unequal label counts
  and every parameter after them equal single-process ``transformers`` (fp32, 1e-5); negative control: a hook that
  keeps the first rows on every rank (the slice misplaced) trains away from it.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.generic.install_state import generic_install
from oslo_models.generic.vocab_embedding import SliceGradient
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

BATCH = 2
LAYOUT = dict(tensor_parallel_size=2, data_parallel_size=2)
EMBEDDING = "model.embed_tokens.weight"


class _FirstRows(SliceGradient):
    """The negative control: every rank keeps the first rows of the whole gradient (rank 1's slice misplaced)."""

    def hook_for(self, param):
        from torch.distributed.tensor import DTensor

        def first_rows(grad):
            local = grad.to_local()[: param.to_local().shape[0]].clone()
            return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())

        return first_rows


def _load(path, hook=None):
    """granite at tp 2 x dp 2; ``hook``: ``"off"`` (the embedding's hooks removed) or a ``SliceGradient`` class."""
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**LAYOUT)).train()
    assert generic_install(model).vocab_slice_gradients == (EMBEDDING,)
    if hook is not None:
        embedding = model.get_input_embeddings()
        for key, pre_hook in list(embedding._forward_pre_hooks.items()):
            if isinstance(pre_hook, SliceGradient):
                del embedding._forward_pre_hooks[key]
        if hook != "off":
            embedding.register_forward_pre_hook(hook(["weight"]))
    return model


def _gradient(model, rows):
    """One forward and backward of ``rows``: the embedding weight's gradient."""
    model(**_collate(rows)).loss.backward()
    return model.get_input_embeddings().weight.grad


def _worker(path):
    import transformers

    rows = sft_rows(101, 48)
    rank = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**LAYOUT)).parallel_context.tp_rank
    rows_here = (51, 50)[rank]
    breadcrumb("memory")
    kept = _gradient(_load(path), rows[:4])
    whole = _gradient(_load(path, hook="off"), rows[:4])
    local = kept.to_local()
    assert tuple(local.shape) == (rows_here, 64) and local.nbytes == rows_here * 64 * 4, local.shape
    assert tuple(whole.to_local().shape) == (101, 64) and whole.to_local().nbytes == 25856, whole.placements
    print(f"tp rank {rank}: embedding gradient {whole.to_local().nbytes} bytes before, {local.nbytes} after",
          flush=True)
    start = 51 * rank
    torch.testing.assert_close(local, whole.to_local()[start:start + rows_here], atol=0, rtol=0)

    reference_class = transformers.GraniteForCausalLM
    for zero_stage, accumulation, hook in ((0, 2, None), (1, 1, None), (0, 1, _FirstRows)):
        breadcrumb(f"zero{zero_stage} accumulation {accumulation} hook {hook}")
        model, logged = prepared_steps(_load(path, hook), rows, batch=BATCH, accumulation=accumulation,
                                       zero_stage=zero_stage)
        reference, expected = reference_steps(reference_class.from_pretrained(path).train(), rows,
                                              BATCH * 2 * accumulation)
        if hook is None:
            torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5)
            assert_same_parameters(model, reference)
        else:
            assert parameters_differ(model, reference), "the misplaced slice matched transformers"
        del model, reference


@pytest.mark.slow
def test_generic_embedding_keeps_its_vocabulary_slice_gradient(tmp_path):
    paths = save(tmp_path / "models", ["granite"])
    run_distributed(_worker, 4, paths["granite"], timeout=600)
