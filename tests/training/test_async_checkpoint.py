"""Asynchronous resumable checkpoints (``save_checkpoint(..., async_=True)``, issue 53).

4 ranks, GPT-2 at tp2 x dp2 ZeRO-3, AdamW: async saves at steps 2 and 4 while training goes on (overlap measured:
optimizer steps finish while the background write is in flight, and the call blocks for the staging only, a small
part of the write); the run's losses are those of a run without saves. Resumed from the step-2 folder - written
while the parameters it holds were being updated - steps 3-6 give the uninterrupted losses exactly (the staging
copied the state; writing the live tensors instead fails this), and from ``latest`` (step 4) at tp1 x dp4 ZeRO-1 to
float tolerance. A background write that fails on one rank (a file-size limit there) is raised on every rank by the
next call, ``latest`` stays on step 4, and the save after it works.

One process killed (SIGKILL) while its background write runs: ``latest`` still names the last complete step, the
interrupted step was never published, and that step loads with the parameters it was saved with.
"""
from __future__ import annotations

import os
import resource
import select
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import oslo_models as om
from oslo_models import training
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import save_tiny_gpt2

STEPS = 6


def _batches(vocab: int):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (8, 16), generator=gen) for _ in range(STEPS)]


def _build(path, tp, zero_stage):
    cfg = om.ParallelConfig(tensor_parallel_size=tp, zero_stage=zero_stage)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    return training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))


def _step(model, opt, ids) -> float:
    ctx = training.unwrap_model(model).parallel_context
    local = ids.chunk(ctx.dp_size)[ctx.dp_rank]
    loss = model(local, labels=local).loss
    loss.backward()
    opt.step(), opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return (mean / dist.get_world_size()).item()


def _worker(path: str, root: str) -> None:
    batches = _batches(211)
    model, opt = _build(path, 2, 3)
    plain = [_step(model, opt, ids) for ids in batches]  # no saves

    model, opt = _build(path, 2, 3)
    writer_of = training.unwrap_model(model)
    losses, overlapped, timings = [], 0, []
    for i, ids in enumerate(batches):
        losses.append(_step(model, opt, ids))
        writer = training.training_state(writer_of).async_writer
        if writer is not None and writer.in_flight():
            overlapped += 1  # this optimizer step ran while the previous save was being written
        if i + 1 in (2, 4):
            breadcrumb(f"async save {i + 1}")
            folder = training.save_checkpoint(root, model, opt, step=i + 1, keep=2, async_=True)
            assert folder.endswith(f"step-{i + 1:08d}")
            if i + 1 == 4:
                timings.append(dict(training.training_state(writer_of).async_writer.timings))
    assert training.wait_for_checkpoint(model).endswith("step-00000004")
    timings.append(dict(training.training_state(writer_of).async_writer.timings))
    assert losses == plain, (losses, plain)  # saving changes nothing
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, (overlapped, {k: round(v, 3) for k, v in timings[-1].items()}))
    if dist.get_rank() == 0:
        print(f"async save: (steps overlapped, last save's seconds) per rank: {counts}")
    assert overlapped >= 1, counts  # training went on while a save was written
    last = timings[-1]
    assert last["staged"] < last["write"], last  # the call blocks for the copy, not for the write

    # the step-2 save, written while steps 3 and 4 updated the parameters it holds, resumes exactly
    resumed, ropt = _build(path, 2, 3)
    info = training.load_checkpoint(os.path.join(root, "step-00000002"), resumed, ropt)
    assert info["step"] == 2 and info["same_layout"]
    assert [_step(resumed, ropt, ids) for ids in batches[2:]] == losses[2:]
    # latest (step 4) at another layout
    other, oopt = _build(path, 1, 1)
    assert training.load_checkpoint(root, other, oopt)["step"] == 4
    torch.testing.assert_close(torch.tensor([_step(other, oopt, ids) for ids in batches[4:]]),
                               torch.tensor(losses[4:]), rtol=1e-5, atol=1e-5)

    # a background write that fails on rank 1: raised by the next call on every rank, latest unchanged
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    training.save_checkpoint(root, model, opt, step=7, keep=2, async_=True)
    _step(model, opt, batches[0])
    with pytest.raises((OSError, RuntimeError), match="failed on rank 1"):  # EFBIG, or torch.save's own error
        training.wait_for_checkpoint(model)
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert training.find_checkpoint(root).endswith("step-00000004")
    assert not os.path.exists(os.path.join(root, ".step-00000007.partial")) or dist.get_rank() != 0
    training.save_checkpoint(root, model, opt, step=8, keep=2, async_=True)
    assert training.wait_for_checkpoint(model).endswith("step-00000008")
    assert training.find_checkpoint(root).endswith("step-00000008")


def test_async_checkpoint_overlaps_and_resumes(tmp_path):
    path = save_tiny_gpt2(tmp_path / "gpt2", n_embd=128, n_layer=4, vocab_size=211)
    run_distributed(_worker, 4, path, str(tmp_path / "ckpt"), timeout=600)


_KILLED = textwrap.dedent("""
    import os, sys, time, torch, oslo_models as om
    from oslo_models import training
    src, root = sys.argv[1], sys.argv[2]
    model = om.AutoModelForCausalLM.from_pretrained(src, progress=False).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(1, 500, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step(), opt.zero_grad()

    step()
    training.save_checkpoint(root, model, opt, step=1)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, os.path.join(root, "..", "step1.pt"))
    step()
    training.save_checkpoint(root, model, opt, step=2, async_=True)
    writer = training.training_state(model).async_writer
    partial = os.path.join(root, ".step-00000002.partial")
    while writer.in_flight() and not (os.path.isdir(partial) and os.listdir(partial)):
        time.sleep(0.001)  # until the background thread is writing files
    print("WRITING" if writer.in_flight() else "DONE-TOO-EARLY", flush=True)
    while True:
        step()
""")


def test_a_kill_during_the_background_write_keeps_the_last_checkpoint(tmp_path):
    src = save_tiny_gpt2(tmp_path / "gpt2", n_embd=512, n_layer=6, vocab_size=500)  # ~80 MB with AdamW state
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", _KILLED, src, str(root)], stdout=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 600)
        line = child.stdout.readline() if ready else b"(nothing within 600 s)"
        assert line.strip() == b"WRITING", line
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert os.path.isdir(root / ".step-00000002.partial")  # killed while writing step 2 ...
    assert not os.path.exists(root / "step-00000002")  # ... which was never published
    assert training.find_checkpoint(root) == str(root / "step-00000001")
    model = om.AutoModelForCausalLM.from_pretrained(src, progress=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert training.load_checkpoint(root, model, opt)["step"] == 1
    expected = torch.load(tmp_path / "step1.pt")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[name]), name
