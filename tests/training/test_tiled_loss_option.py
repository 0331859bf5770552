"""``ParallelConfig.tiled_loss`` (issue 52): a causal LM's training loss runs fused with the LM head in row chunks
(``skip_logits=True`` on every training forward with labels), counted by the planner and set by the example's
``--tiled-loss`` (with ``--tiled-mlp`` and ``--activation-offload``).

- Llama (tiny, single process) with ``tiled_loss=True``: 3 AdamW steps on right-padded rows of unequal label
  counts give the losses and parameters of ``transformers`` (1e-5); the training output has no logits, and one
  training forward keeps at least the ``[b, s, V]`` fp32 logits' bytes less than the plain model (negative
  control: the same model with the option off keeps them); in eval mode the logits are ``transformers``'.
- The planner: ``ParallelConfig(tiled_loss=True)`` predicts what ``estimate_memory(..., tiled_loss=True)`` does, less
  than the plain config.
- Config: a non-bool is refused (pipeline parallelism is accepted: ``tests/pipeline/test_pipeline_tiled_loss.py``);
  the example's options parse into the config, a bad ``--tiled-mlp`` is a usage error;
  ``examples/train_clm.py --tiled-mlp 2 --tiled-loss --activation-offload --pack`` trains 2 steps of its small
  GPT-2 (one process) to finite losses.
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

import oslo_models as om
from oslo_models.planner.facts import ModelFacts
from oslo_models.planner.memory import activation_bytes
from tests.helpers.decoders import hf_class, save_tiny
from tests.helpers.models import padded_batch
from tests.helpers.zoo import tiny_config
from tests.training.test_long_sequence_tools import _SavedBytes

TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def test_tiled_loss_trains_as_transformers(tmp_path):
    path = save_tiny(tmp_path, "llama")
    model = om.AutoModelForCausalLM.from_pretrained(path, progress=False,
                                                    parallel=om.ParallelConfig(tiled_loss=True)).train()
    reference = hf_class("llama").from_pretrained(path).train()
    opt, ref_opt = _adamw(model.parameters()), _adamw(reference.parameters())
    for step in range(3):
        ids, mask, labels = padded_batch(101, batch=3, seq=12, seed=step)
        out = model(ids, attention_mask=mask, labels=labels)
        expected = reference(ids, attention_mask=mask, labels=labels).loss
        assert out.logits is None
        torch.testing.assert_close(out.loss, expected, **TOL)
        out.loss.backward(), expected.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), ref_params[name].detach(), **PARAM_TOL, msg=name)
    model.eval(), reference.eval()
    ids, mask, labels = padded_batch(101, batch=3, seq=12, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask, labels=labels).logits,
                                   reference(ids, attention_mask=mask, labels=labels).logits, **TOL)


def test_tiled_loss_keeps_no_logits(tmp_path):
    path = save_tiny(tmp_path, "llama", vocab_size=2000)
    ids = torch.randint(1, 2000, (2, 64), generator=torch.Generator().manual_seed(0))
    saved = {}
    for tiled in (False, True):
        model = om.AutoModelForCausalLM.from_pretrained(path, progress=False,
                                                        parallel=om.ParallelConfig(tiled_loss=tiled)).train()
        hooks = _SavedBytes()
        with hooks:
            out = model(ids, labels=ids)
        saved[tiled] = hooks.total
        assert (out.logits is None) == tiled
    assert saved[False] - saved[True] >= ids.numel() * 2000 * 4, saved


def test_planner_counts_the_option():
    config = tiny_config("llama", num_hidden_layers=2, hidden_size=64, vocab_size=2000)
    facts = ModelFacts(om.LlamaForCausalLM, config)
    shape = dict(micro_batch=2, seq_len=256, num_microbatches=1)
    tiled = activation_bytes(facts, om.ParallelConfig(tiled_loss=True), **shape)
    assert tiled == activation_bytes(facts, om.ParallelConfig(), tiled_loss=True, **shape)
    assert tiled < activation_bytes(facts, om.ParallelConfig(), **shape)


def test_config_and_example_options():
    with pytest.raises(ValueError, match="tiled_loss must be a bool"):
        om.ParallelConfig(tiled_loss="yes")
    assert om.ParallelConfig(tiled_loss=True, pipeline_parallel_size=2).tiled_loss  # tests/pipeline/
    # test_pipeline_tiled_loss.py trains it
    with pytest.raises(NotImplementedError, match="tensor_parallel_mode='2d'"):
        om.ParallelConfig(tiled_loss=True, pipeline_parallel_size=2, tensor_parallel_size=4, tensor_parallel_mode="2d")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples"))
    import train_clm
    from _common import UsageError

    args = train_clm.parse_args(["--tiled-mlp", "auto", "--tiled-loss", "--activation-offload", "--pack"])
    cfg = train_clm.with_long_sequence_options(args, om.ParallelConfig())
    assert (cfg.tiled_mlp, cfg.tiled_loss, cfg.activation_offload) == ("auto", True, True) and args.pack
    args = train_clm.parse_args(["--tiled-mlp", "3", "--activation-offload", "4096"])
    cfg = train_clm.with_long_sequence_options(args, om.ParallelConfig())
    assert (cfg.tiled_mlp, cfg.tiled_loss, cfg.activation_offload) == (3, False, 4096)
    with pytest.raises(UsageError, match="--tiled-mlp"):
        train_clm.with_long_sequence_options(train_clm.parse_args(["--tiled-mlp", "many"]), om.ParallelConfig())


def test_example_trains_with_the_flags(tmp_path):
    from tests.helpers.examples import TINY, launch

    launch([sys.executable], "train_clm.py", "--steps", "2", "--tiled-mlp", "2", "--tiled-loss",
           "--activation-offload", "--pack", *TINY, "--output", str(tmp_path))
    with open(tmp_path / "loss.json", encoding="utf-8") as handle:
        record = json.load(handle)
    assert len(record["losses"]) == 2 and all(math.isfinite(loss) for loss in record["losses"])
    assert (record["args"]["tiled_mlp"], record["args"]["tiled_loss"], record["args"]["activation_offload"]) == \
        ("2", True, True)
