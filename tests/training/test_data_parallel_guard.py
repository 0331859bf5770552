"""Data parallelism is never inert: a model whose world has dp x cp > 1, trained without a data-parallel wrapper,
raises at its first backward (``distributed/data_parallel.py``: ``install_data_parallel_guard``).

One spawned group of 2 gloo ranks, tiny Llama: dp2 and cp2 unwrapped raise (the negative control: the same model
through ``training.prepare`` / ``data_parallel`` / ``mark_gradients_reduced`` trains); eval mode and ``no_grad``
never raise; pipelines (their ``train_step`` reduces over dp itself) carry no guard.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models import training
from oslo_models.data import ContextParallelSplitter
from oslo_models.distributed import gradients_reduced_by, mark_gradients_reduced
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.models import padded_batch

MESSAGE = "nothing reduces its gradients"


def _load(path: str, **options):
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**options), progress=False)


def _worker(path: str) -> None:
    from accelerate import Accelerator

    ids, mask, labels = padded_batch(101, batch=2, seq=8)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    for options in (dict(data_parallel_size=2), dict(context_parallel_size=2)):
        model = _load(path, **options).train()
        local = ContextParallelSplitter(model.parallel_context)(batch) if "context_parallel_size" in options else batch
        with pytest.raises(RuntimeError, match=MESSAGE):
            model(**local).loss.backward()
        assert all(p.grad is None for p in model.parameters())  # raised before any gradient was accumulated
        with torch.no_grad():
            model(**local)
        model.eval()
        model(**local).loss.backward()  # eval mode: not a training step (e.g. saliency), no guard
        model.zero_grad()
        marked = _load(path, **options).train()
        mark_gradients_reduced(marked, "caller")
        marked(**local).loss.backward()
        assert gradients_reduced_by(marked) == "caller"
    for stage in (3,):  # prepare marks the model (FSDP2 here; DDP and ZeRO-1 through om.data_parallel, below)
        model = _load(path, data_parallel_size=2).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        wrapped, optimizer = training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=stage)
        wrapped(**batch).loss.backward()
        optimizer.step()
        assert gradients_reduced_by(model) is not None
    wrapped = om.data_parallel(_load(path, data_parallel_size=2).train())
    wrapped(**batch).loss.backward()
    compiled = torch.compile(_load(path, data_parallel_size=2).train(), backend="eager")
    mark_gradients_reduced(compiled, "caller")  # reaches the model inside
    assert gradients_reduced_by(compiled._orig_mod) == "caller"
    model = _load(path, pipeline_parallel_size=2, num_microbatches=2)
    assert not model._forward_hooks  # the runner reduces a pipeline's gradients over dp x cp itself


def test_unwrapped_data_parallel_backward_raises(tmp_path):
    path = decoders.save_tiny(tmp_path / "llama", "llama")
    run_distributed(_worker, 2, path, timeout=300)
