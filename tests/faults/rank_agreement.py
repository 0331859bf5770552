"""A failure that only some ranks see is every rank's clear error within seconds, never a hang.

Pipeline stages read only their own tensors and tensor-parallel ranks can fail to read on one node only; every rank
writes its share of a Hub folder and any one can fail; ``if rank == 0: model.save_pretrained(...)`` leaves the other
ranks out of the save. In each
case every rank must raise the same error (``distributed.agreement``) quickly. CPU, gloo: ``world2`` and ``world4``
run in the spawned worlds of ``test_worlds.py`` (whose timeout fails a hang instead of holding CI)."""
from __future__ import annotations

import json
import os
import re
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file, save_file

import oslo_models as om
from oslo_models import training
from oslo_models.conversion import hub_export
from oslo_models.conversion.checkpoint import CheckpointReader
from oslo_models.conversion.loading import MismatchedSizeError
from tests.helpers.models import save_tiny_gpt2, tiny_gpt2_config

FAST = 30.0  # seconds: "within seconds" on a loaded 2-core CI box
STAGE1_KEY = "transformer.h.1.mlp.c_fc.weight"  # held by pipeline stage 1 only (2 layers, 2 stages)


def same_error_everywhere(fn, match: str, *, expected_type=None):
    """Run ``fn`` on every rank; every rank must raise the same error (type and text) matching ``match`` fast."""
    start = time.monotonic()
    try:
        fn()
        outcome = None
    except Exception as error:  # noqa: BLE001 - compared across ranks below
        outcome = (type(error).__name__, str(error))
    elapsed = time.monotonic() - start
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (outcome, elapsed))
    assert outcome is not None, f"rank {dist.get_rank()} did not fail; outcomes {outcomes}"
    assert all(item[0] == outcome for item in outcomes), outcomes
    assert re.search(match, outcome[1]), outcome
    if expected_type is not None:
        assert outcome[0] == expected_type.__name__, outcome
    assert max(item[1] for item in outcomes) < FAST, outcomes
    return outcome[1]


def load(path, **parallel):
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**parallel), progress=False)


def read_fails_on(rank: int):
    """An I/O error on one node only: that rank's slice reads fail."""
    real = CheckpointReader.read

    def read(self, key, index=None):
        if dist.get_rank() == rank:
            raise OSError(f"injected read error on rank {rank}")
        return real(self, key, index)

    return mock.patch.object(CheckpointReader, "read", read)


def world2(paths):
    """tp 2 and pp 2 in a world of 2 (initialized: the library joins it; the checks below need one at once)."""
    rank = dist.get_rank()
    good = paths["good"]
    # tp2: rank 1's reads fail; rank 0 loads everything and would otherwise walk on alone.
    with read_fails_on(1):
        same_error_everywhere(lambda: load(good, tensor_parallel_size=2),
                              r"failed on rank 1: OSError: injected read error on rank 1", expected_type=OSError)
    # pp2: a tensor only stage 1 reads has the wrong shape; a tensor missing from its shard; a truncated shard.
    same_error_everywhere(lambda: load(paths["bad_shape"], pipeline_parallel_size=2),
                          rf"failed on rank 1: MismatchedSizeError: Checkpoint tensor '{STAGE1_KEY}' has shape "
                          r"\(32, 127\), but the model config needs \(32, 128\)", expected_type=MismatchedSizeError)
    same_error_everywhere(lambda: load(paths["missing"], pipeline_parallel_size=2),
                          rf"no shard holds: '{STAGE1_KEY}'", expected_type=ValueError)
    same_error_everywhere(lambda: load(paths["truncated"], pipeline_parallel_size=2), r"is truncated",
                          expected_type=ValueError)

    model = load(good, tensor_parallel_size=2)
    out = os.path.join(paths["tmp"], "hub")
    # Rank 0 alone saving: a clear error naming the rule within seconds, not a gather waiting forever.
    os.environ["OSLO_ARRIVAL_TIMEOUT"] = "3"
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"save_pretrained is collective: every rank calls "
                                               r"model.save_pretrained\(\).*rank\(s\) \[1\] of 2 never called it"):
            model.save_pretrained(out)
        assert time.monotonic() - start < FAST
    dist.barrier()
    del os.environ["OSLO_ARRIVAL_TIMEOUT"]
    model.save_pretrained(out)  # everyone calling afterwards still works (the failed arrival was withdrawn)
    # Rank 1 failing to write its share (every rank writes): every rank gets its error, the folder is still the
    # complete previous one.
    real_write_box = hub_export.write_box

    def write_box_fails_on_rank1(*args, **kwargs):
        if rank == 1:
            raise OSError("disk full")
        return real_write_box(*args, **kwargs)

    with mock.patch.object(hub_export, "write_box", write_box_fails_on_rank1):
        same_error_everywhere(lambda: model.save_pretrained(out), r"failed on rank 1: OSError: disk full",
                              expected_type=OSError)
    if rank == 0:
        reference = transformers.AutoModelForCausalLM.from_pretrained(good)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        ids = torch.tensor([[1, 2, 3, 4]])
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)

    # Training checkpoints: a rank that fails to write or to read does not leave the other waiting.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = os.path.join(paths["tmp"], "ckpt")
    training.save_checkpoint(ckpt, model, opt, step=1)
    real_save = training.checkpoint._save_synced

    def save_fails_on_rank1(obj, path):
        if rank == 1:
            raise OSError("No space left on device (injected)")
        real_save(obj, path)

    with mock.patch.object(training.checkpoint, "_save_synced", save_fails_on_rank1):
        same_error_everywhere(lambda: training.save_checkpoint(ckpt, model, opt, step=2),
                              r"failed on rank 1: OSError: No space left", expected_type=OSError)
    assert training.find_checkpoint(ckpt).endswith("step-00000001")  # the last good one is still there
    real_load = torch.load

    def load_fails_on_rank1(*args, **kwargs):
        if rank == 1:
            raise OSError("injected read error")
        return real_load(*args, **kwargs)

    with mock.patch.object(training.checkpoint.torch, "load", load_fails_on_rank1):
        same_error_everywhere(lambda: training.load_checkpoint(ckpt, model, opt),
                              r"load_checkpoint\(.*step-00000001'\) failed on rank 1: OSError: injected",
                              expected_type=OSError)
    assert training.load_checkpoint(ckpt, model, opt)["step"] == 1


def world4(paths):
    """pp 2 x tp 2 in a world of 4."""
    # pp2 x tp2: stage 1 (ranks 2, 3) finds the bad tensor; stage 0 would otherwise enter training alone.
    same_error_everywhere(lambda: load(paths["bad_shape"], pipeline_parallel_size=2, tensor_parallel_size=2),
                          rf"failed on rank 2: MismatchedSizeError: Checkpoint tensor '{STAGE1_KEY}' has shape "
                          r"\(32, 127\).*\(ranks \[3\] failed too\)", expected_type=MismatchedSizeError)
    with read_fails_on(1):  # stage 0's second tp rank cannot read
        same_error_everywhere(lambda: load(paths["good"], pipeline_parallel_size=2, tensor_parallel_size=2),
                              r"failed on rank 1: OSError: injected read error", expected_type=OSError)


def _rewrite(source: str, target, edit) -> str:
    """Copy of the single-file checkpoint ``source`` with ``edit(weights)`` applied."""
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(source):
        if name != "model.safetensors":
            open(os.path.join(target, name), "wb").write(open(os.path.join(source, name), "rb").read())
    weights = load_file(os.path.join(source, "model.safetensors"))
    edit(weights)
    save_file(weights, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    return str(target)


def checkpoints(root) -> dict:
    """The Hub folders the workers load: a good tiny GPT-2 and three broken copies; ``tmp`` for their saves."""
    good = save_tiny_gpt2(root / "good")
    bad_shape = _rewrite(good, root / "bad_shape", lambda w: w.update({STAGE1_KEY: w[STAGE1_KEY][:, :-1].clone()}))
    missing = root / "missing"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(missing, max_shard_size="20KB")
    index = json.load(open(missing / "model.safetensors.index.json"))
    shard_name = index["weight_map"][STAGE1_KEY]
    shard = load_file(missing / shard_name)
    del shard[STAGE1_KEY]
    save_file(shard, str(missing / shard_name), metadata={"format": "pt"})
    truncated = _rewrite(good, root / "truncated", lambda w: None)
    data = open(os.path.join(truncated, "model.safetensors"), "rb").read()
    open(os.path.join(truncated, "model.safetensors"), "wb").write(data[: len(data) - 200])
    return {"good": good, "bad_shape": bad_shape, "missing": str(missing), "truncated": truncated,
            "tmp": str(root)}

