"""Checkpoint integrity at tp > 1 (4 gloo processes, one spawn): the short-vocabulary checkpoint is refused at tp 2
and 4 (padded local shapes cannot tell 99 rows from 100), a parameter missing from the checkpoint is newly
initialized with the tp=1 values sliced and a warning, and a base model loads from a checkpoint saved with a
head."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from tests.conversion.test_integrity import IDS, short_vocab_checkpoint
from tests.helpers.dist import run_distributed
from tests.helpers.models import expected_shard, save_tiny_gpt2


def _worker(head_checkpoint, short_checkpoint):
    for tp in (2, 4):  # tp=1 is test_integrity.test_short_vocab_refused_at_tp1
        with pytest.raises(ValueError, match=r"'transformer.wte.weight' has shape \(99, 32\), but the model config "
                                             r"needs \(100, 32\)"):
            om.AutoModelForCausalLM.from_pretrained(short_checkpoint, progress=False,
                                                    parallel=om.ParallelConfig(tensor_parallel_size=tp))

    # A deeper model from a shallower checkpoint: layer 2 is new. At tp=2 each rank holds the slices of the
    # weights tp=1 draws (same seed), at the right local shapes, and the loader warns as transformers does.
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("oslo_models.conversion.loading").addHandler(handler)
    full = om.AutoModelForCausalLM.from_pretrained(head_checkpoint, n_layer=3, progress=False)  # tp=1 (dp=4)
    split = om.AutoModelForCausalLM.from_pretrained(head_checkpoint, n_layer=3, progress=False,
                                                    parallel=om.ParallelConfig(tensor_parallel_size=2))
    warnings = [record.getMessage() for record in records]
    assert any("newly initialized" in w and "transformer.h.2.attn.c_attn.weight" in w for w in warnings), warnings
    full_params = dict(full.named_parameters())
    new = [name for name in full_params if name.startswith("transformer.h.2.")]
    assert len(new) == 12
    for name, param in split.named_parameters():
        expected = expected_shard(split, name, full_params[name].detach())
        assert param.shape == expected.shape, name
        assert torch.equal(param, expected), name
    c_attn = dict(split.named_parameters())["transformer.h.2.attn.c_attn.weight"]
    assert c_attn.shape == (32, 48) and c_attn.abs().sum() > 0  # split and initialized, not zeros

    # A base model (AutoModel) from a checkpoint saved with the LM head: transformers' hidden states.
    base = om.AutoModel.from_pretrained(head_checkpoint, progress=False,
                                        parallel=om.ParallelConfig(tensor_parallel_size=2))
    reference = transformers.AutoModel.from_pretrained(head_checkpoint).eval()
    torch.testing.assert_close(base(IDS).last_hidden_state, reference(IDS).last_hidden_state, atol=1e-5, rtol=1e-5)
    dist.barrier()


def test_integrity_at_tp2_and_tp4(tmp_path):
    head = save_tiny_gpt2(tmp_path / "head")
    short = short_vocab_checkpoint(tmp_path / "short")
    run_distributed(_worker, 4, head, short, timeout=240)
