"""Packed batches on a pipelined generic causal LM attend per document (``generic/pipeline_stage.py`` with
``generic/packed_attention.py``): the same loss and gradients as one document per row.

One spawned group of 4 gloo processes at pp 2 x dp 2 (1F1B, one row per microbatch), the packed global batch of
``test_generic_packed`` (4 rows of 12 tokens, 2-4 documents each): Granite (restarting ``position_ids``, no attention
mask), Cohere 2 (sliding-window and full layers, one mask per layer type; ``position_ids`` and a padded row) and
XGLM (sinusoidal positions, ``cu_seqlens`` alone, turned into per-row document ids before the microbatch split). The
logged loss of one ``train_step`` and every gradient equal single-process ``transformers`` on the documents one per
row (fp32, 1e-5). Negative control: the same batch without its packing keys (the documents of a row attend to each
other) is off the per-document loss. A state-space model (Mamba) given a packed batch is refused before the
schedule's first send.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models import training
from oslo_models.generic.install_state import generic_install
from tests.generic.test_generic_packed import ROWS, TYPES, _config, _inputs, packed_batch, reference
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.global_loss import with_global_share

TOL = dict(rtol=1e-5, atol=1e-5)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _load(path):
    from accelerate import Accelerator

    parallel = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel).train()
    wrapped, _ = training.prepare(Accelerator(cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.0))
    return wrapped, model


def _step(wrapped, model, batch):
    context = model.parallel_context
    loss = wrapped.train_step(with_global_share(model, batch, True))
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total / context.world_size


def _worker(paths, refs, mamba_path):
    ids, pos, mask, labels = packed_batch()
    for name, (how, _) in TYPES.items():
        breadcrumb(f"{name} packed pp2 x dp2")
        ref_loss, ref_grads, _ = refs[name]
        wrapped, model = _load(paths[name])
        context = model.parallel_context
        rows = slice(context.dp_rank * len(ROWS) // 2, (context.dp_rank + 1) * len(ROWS) // 2)
        batch = _inputs(how, ids[rows], pos[rows], mask[rows], labels[rows])
        torch.testing.assert_close(_step(wrapped, model, batch), ref_loss, msg=lambda m: f"{name} loss: {m}", **TOL)
        tied = dict(generic_install(model).pipeline_adapter.tied_groups(model))  # {embedding: head}
        for pname, param in model.named_parameters():
            expected = ref_grads.get(pname, ref_grads.get(next((e for e, h in tied.items() if h == pname), "")))
            torch.testing.assert_close(_full(param.grad), expected, msg=lambda m, p=pname: f"{name} {p}: {m}",
                                       **TOL)
        # negative control: without its packing keys the row's documents attend to each other
        model.zero_grad()
        leaked = _step(wrapped, model, dict(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]))
        assert (leaked - ref_loss).abs() > 1e-4, (name, leaked, ref_loss)
    breadcrumb("mamba refused")
    wrapped, model = _load(mamba_path)
    with pytest.raises(NotImplementedError, match="not attention"):
        wrapped.train_step(dict(input_ids=ids[:2], position_ids=pos[:2], labels=labels[:2]))


@pytest.mark.slow
def test_generic_pipeline_packed_batches(tmp_path):
    from tests.generic.models import save

    paths, refs = {}, {}
    for name in TYPES:
        torch.manual_seed(0)
        paths[name] = str(tmp_path / name)
        transformers.AutoModelForCausalLM.from_config(_config(name)).save_pretrained(paths[name])
        refs[name] = reference(paths[name])
    mamba = save(tmp_path / "models", ["mamba"])["mamba"]
    run_distributed(_worker, 4, paths, refs, mamba, timeout=900)
