"""A full disk at every write of a save, on every rank; a corrupt checkpoint on resume; a NaN on one rank only.
One tp=2 gloo world.

Full disk (``write_faults.WriteFaults``): for ``training.save_checkpoint`` and ``training.save_pretrained`` (every
rank writes its share of the Hub folder) each write site of each rank in turn (files, native writers, ``pwrite``,
mkdir, fsync) fails with ``OSError(ENOSPC)``. After each: every rank raised the same ``OSError`` (errno ENOSPC,
message naming the failing rank), ``latest`` still names the previous step, whose files still match their
checksums, and nothing of the failed save is left behind; the previous Hub folder is byte-identical. A site whose
failure the save legitimately absorbs (``makedirs`` of a folder that exists) must instead give a complete, verified
new step.
Negative controls: a save written in place over the previous step (the previous checkpoint's checksums catch it)
and a write guarded by one rank alone (the other rank does not fail) are reported by the same checker.

Corrupt checkpoint: a truncated file and a flipped byte in the newest step are found before anything is loaded, on
every rank, naming the file; ``fallback=True`` loads the previous step (its exact parameters). Negative control:
with the checksums removed (a folder saved before they existed) the flipped byte loads silently as other weights.

NaN on one rank: a loss that is NaN on rank 1 only is found on both ranks together (``find_nonfinite``), and
``check_finite`` raises the same ``NonFiniteError`` on both (negative control: each rank's own ``isfinite`` answers
differently, which the same comparison catches); a NaN in rank 1's shard of a weight makes ``save_checkpoint``
refuse on both ranks, ``latest`` unchanged.

``world2`` runs in the spawned world of 2 of ``test_worlds.py``.
"""
from __future__ import annotations

import errno
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import oslo_models as om
from oslo_models import training
from oslo_models.training.checkpoint_integrity import CHECKSUMS, CorruptCheckpointError, digest, verify_checksums
from tests.faults.write_faults import WriteFaults
from tests.helpers.models import tiny_gpt2_config

PREVIOUS = "step-00000001"


def _outcome(fn):
    try:
        fn()
        return None
    except Exception as error:  # noqa: BLE001 - compared across ranks
        return type(error).__name__, str(error), getattr(error, "errno", None)


def _gather(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _step(model, opt, seed):
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model):
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def checkpoint_problems(context, outcomes, root, failing_rank) -> list[str]:
    """What is wrong after a save that should have failed with ENOSPC on ``failing_rank`` (collective)."""
    problems = []
    try:  # every rank verifies its share of the previous step: collective, so always called
        verify_checksums(context, os.path.join(root, PREVIOUS))
    except CorruptCheckpointError as error:
        problems.append(f"the previous checkpoint is damaged: {error}")
    if any(outcome is None for outcome in outcomes):
        problems.append(f"rank(s) {[r for r, o in enumerate(outcomes) if o is None]} did not fail: {outcomes}")
    elif len({outcome[:2] for outcome in outcomes}) > 1:
        problems.append(f"ranks raised different errors: {outcomes}")
    else:
        kind, message, code = outcomes[0]
        if code != errno.ENOSPC or f"failed on rank {failing_rank}" not in message:
            problems.append(f"not the full disk of rank {failing_rank}: {outcomes[0]}")
    latest = open(os.path.join(root, "latest")).read().strip()
    if latest != PREVIOUS or training.find_checkpoint(root) != os.path.join(root, PREVIOUS):
        problems.append(f"latest names {latest}, find_checkpoint {training.find_checkpoint(root)}")
    left = [entry for entry in os.listdir(root) if entry.endswith(".partial")]
    if left:
        problems.append(f"left behind: {left}")
    return problems


def _reset_to_previous(context, root):
    """After a save that went through: back to ``latest`` = the previous step (test bookkeeping, rank 0)."""
    dist.barrier()
    if context.rank == 0:
        shutil.rmtree(os.path.join(root, "step-00000002"), ignore_errors=True)
        with open(os.path.join(root, "latest"), "w") as handle:
            handle.write(PREVIOUS + "\n")
    dist.barrier()


def _sweep_checkpoint(model, opt, root):
    context = model.parallel_context
    save = lambda: training.save_checkpoint(root, model, opt, step=2, keep=2)  # noqa: E731
    with WriteFaults() as counter:
        save()
    sites = _gather(counter.sites)
    _reset_to_previous(context, root)
    failed, absorbed = [], []
    for failing_rank, rank_sites in enumerate(sites):
        for site in _representatives(rank_sites):
            with WriteFaults(site if context.rank == failing_rank else -1):
                outcomes = _gather(_outcome(save))
            if all(outcome is None for outcome in outcomes):  # absorbed: the new step must then be complete
                verify_checksums(context, os.path.join(root, "step-00000002"))
                assert training.find_checkpoint(root).endswith("step-00000002"), (failing_rank, rank_sites[site])
                absorbed.append(rank_sites[site])
                _reset_to_previous(context, root)
                continue
            problems = checkpoint_problems(context, outcomes, root, failing_rank)
            assert not problems, (failing_rank, site, rank_sites[site], problems)
            failed.append((rank_sites[site], outcomes[0][1]))
    # only makedirs(exist_ok=True) of a folder that exists may absorb the error; every file write must fail
    assert len(failed) >= 10 and all(site.startswith("mkdir") for site in absorbed), (failed, absorbed, sites)
    return failed


def _representatives(sites: list[str]) -> list[int]:
    """Indices of ``sites`` to fail: each site, but of a run of the same site (fsync of every file of a tree)
    only the first and the last."""
    return [i for i, site in enumerate(sites)
            if i == 0 or i == len(sites) - 1 or sites[i - 1] != site or sites[i + 1] != site]


def _negative_controls(context, root, model):
    """The checker catches a save written in place and an error on one rank only."""
    previous = os.path.join(root, PREVIOUS)
    backup = previous + ".bak"
    if context.rank == 0:
        shutil.copytree(previous, backup)
    dist.barrier()
    # 1. in place over the previous step (no staging folder): the full disk damages the last good checkpoint
    with WriteFaults(0 if context.rank == 0 else -1):
        outcome = _outcome(lambda: context.rank == 0 and torch.save(_snapshot(model), os.path.join(
            previous, "trainer_state.pt")))
    problems = checkpoint_problems(context, _gather(outcome), root, 0)
    assert any("previous checkpoint is damaged" in p and "trainer_state.pt: " in p for p in problems), problems
    # 2. a write on rank 1 alone, its error not agreed: rank 0 walks on
    with WriteFaults(0 if context.rank == 1 else -1):
        outcome = _outcome(lambda: context.rank == 1 and torch.save({}, os.path.join(root, "side.pt")))
    problems = checkpoint_problems(context, _gather(outcome), root, 1)
    assert any("rank(s) [0] did not fail" in p for p in problems), problems
    dist.barrier()
    if context.rank == 0:
        shutil.rmtree(previous)
        os.rename(backup, previous)
        os.remove(os.path.join(root, "side.pt"))
    dist.barrier()


def _sweep_hub(model, hub):
    """Each write site of each rank (every rank writes its share of the Hub folder) fails in turn."""
    context = model.parallel_context
    training.save_pretrained(model, hub)
    before = {name: digest(os.path.join(hub, name)) for name in sorted(os.listdir(hub))}
    with WriteFaults() as counter:
        training.save_pretrained(model, hub)
    every = _gather(counter.sites)
    assert all(any(site.startswith("pwrite") for site in sites) for sites in every), "every rank writes tensors"
    for rank, sites in enumerate(every):
        for site in _representatives(sites):
            with WriteFaults(site if context.rank == rank else -1):
                outcomes = _gather(_outcome(lambda: training.save_pretrained(model, hub)))
            after = {name: digest(os.path.join(hub, name)) for name in sorted(os.listdir(hub))}
            assert after == before, (rank, site, sites[site])
            if all(outcome is None for outcome in outcomes):
                continue  # absorbed (e.g. makedirs of the existing parent): the folder is the same model
            assert len({outcome[:2] for outcome in outcomes}) == 1 and None not in outcomes, (site, outcomes)
            assert outcomes[0][2] == errno.ENOSPC and f"failed on rank {rank}" in outcomes[0][1], (site, outcomes)
            parent = os.path.dirname(hub)
            assert not [e for e in os.listdir(parent) if e.startswith(".hub.saving-")], (site, os.listdir(parent))
    return every


def _flip_byte(path, offset=None):
    data = bytearray(open(path, "rb").read())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x10
    open(path, "wb").write(bytes(data))


def _corruption(model, opt, root, snapshots):
    context = model.parallel_context
    newest = os.path.join(root, "step-00000002")
    victim = os.path.join(newest, "__1_0.distcp")  # written by rank 1, verified by whichever rank's share it is
    backup = os.path.join(root, "victim.bak")
    if context.rank == 0:
        shutil.copy(victim, backup)
        os.truncate(victim, os.path.getsize(victim) - 100)
    dist.barrier()
    for p in model.parameters():
        p.data.zero_()
    with pytest.raises(CorruptCheckpointError, match=r"corrupt checkpoint .*step-00000002: .*__1_0\.distcp: truncated"):
        training.load_checkpoint(root, model, opt)
    assert all(not p.detach().any() for p in model.parameters())  # nothing was loaded
    info = training.load_checkpoint(root, model, opt, fallback=True)
    assert info["step"] == 1 and info["path"].endswith(PREVIOUS) and "truncated" in info["skipped"][0][1], info
    for name, param in model.named_parameters():
        assert torch.equal(param, snapshots[1][name]), name  # exactly the previous step
    # a byte inside rank 1's piece of a weight (its local shard, stored as is): an exponent bit of one float
    local = snapshots[2]["transformer.h.0.mlp.c_fc.weight"].contiguous()
    offset = open(backup, "rb").read().find(local.numpy().tobytes()) if context.rank == 1 else None
    offset = _gather(offset)[1]
    assert offset is not None and offset > 0, offset
    dist.barrier()
    if context.rank == 0:
        shutil.copy(backup, victim)
        _flip_byte(victim, offset + 3)
    dist.barrier()
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp: its content changed since the save"):
        training.load_checkpoint(root, model, opt)
    # Negative control: the same flipped byte without checksums (a folder from before they existed) loads silently
    dist.barrier()
    if context.rank == 0:
        os.remove(os.path.join(newest, CHECKSUMS))
    dist.barrier()
    info = training.load_checkpoint(root, model, opt)
    assert info["step"] == 2
    differs = [name for name, param in model.named_parameters() if not torch.equal(param, snapshots[2][name])]
    differs = _gather(differs)
    assert any(differs), "the flipped byte changed no weight: the negative control shows nothing"


def _nonfinite(model, opt, root):
    context = model.parallel_context
    loss = torch.tensor(float("nan") if context.rank == 1 else 2.5)
    found = training.find_nonfinite(model, loss=loss, grad_norm=torch.tensor(1.0))
    assert _gather(found) == [{"loss": [1], "grad_norm": []}] * 2
    outcomes = _gather(_outcome(lambda: training.check_finite(model, loss=loss, step=7)))
    assert outcomes[0] == outcomes[1] == ("NonFiniteError", "non-finite (NaN/inf) values at step 7: the loss on "
                                                           "rank(s) [1]", None), outcomes
    local = _gather(math.isfinite(loss.item()))  # negative control: the per-rank check disagrees
    assert local == [True, False]
    weight = dict(model.named_parameters())["transformer.h.1.mlp.c_proj.weight"]
    kept = weight.detach().clone()
    if context.rank == 1:
        with torch.no_grad():
            weight[0, 0] = float("nan")
    outcomes = _gather(_outcome(lambda: training.save_checkpoint(root, model, opt, step=3, keep=2)))
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "NonFiniteError", outcomes
    assert "failed on rank 1: NonFiniteError: parameter transformer.h.1.mlp.c_proj.weight holds NaN" in outcomes[0][1]
    assert training.find_checkpoint(root).endswith("step-00000002") and not os.path.exists(
        os.path.join(root, ".step-00000003.partial"))
    with torch.no_grad():
        weight.copy_(kept)


def world2(tmp):
    torch.manual_seed(0)
    model = om.AutoModelForCausalLM.from_config(tiny_gpt2_config(), parallel=om.ParallelConfig(
        tensor_parallel_size=2))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = os.path.join(tmp, "ckpt")
    snapshots = {}
    _step(model, opt, 0)
    training.save_checkpoint(root, model, opt, step=1, keep=2)
    snapshots[1] = _snapshot(model)
    _step(model, opt, 1)
    _sweep_checkpoint(model, opt, root)
    _negative_controls(model.parallel_context, root, model)
    _sweep_hub(model, os.path.join(tmp, "hub"))
    training.save_checkpoint(root, model, opt, step=2, keep=2)  # after all that, a save still works
    snapshots[2] = _snapshot(model)
    assert sorted(e for e in os.listdir(root) if e.startswith("step-")) == [PREVIOUS, "step-00000002"]
    _nonfinite(model, opt, root)
    _corruption(model, opt, root, snapshots)

