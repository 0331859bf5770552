"""Kill -9 a save at every step and check the last good checkpoint (run by ``test_save_kills.py``).

``python -m tests.faults.kill_driver WORKDIR`` builds a tiny GPT-2 once, then for each save path (``save_pretrained``
with the atomic exchange, ``save_pretrained`` on a file system without it, ``training.save_checkpoint``) counts the
file-system steps of one save (mkdir, file writes - the Hub writer's ``os.pwrite`` of each tensor box into the
pre-sized shard files -, renames, removals) and, for every step k, forks a child that SIGKILLs itself just before
step k. After each kill the parent checks what is on disk:

- Hub folder: plain ``transformers`` loads it and gives exactly the old or the new model's logits (with the
  fallback renames, after ``recover_folder``), and never the new one before the publishing step;
- training checkpoint: ``load_checkpoint`` resumes at the old or the new step, and training on to the end gives
  losses and parameters bit-identical to an uninterrupted run (dropout on, so the RNG state must be right too).

Prints one JSON line: for each path, the number of kill points and the state found after each.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import oslo_models as om  # noqa: E402
from oslo_models import training  # noqa: E402
from oslo_models.conversion import atomic  # noqa: E402

torch.set_num_threads(1)
IDS = torch.tensor([[1, 5, 9, 33, 7, 2, 11, 4]])
STEPS = 6
# (module, attribute) pairs whose calls are the visible steps of a save; a kill lands just before one of them.
# fsync is not one: it changes nothing a killed process leaves behind (it matters for power loss only).
STEP_CALLS = [(os, "mkdir"), (os, "rename"), (os, "replace"), (os, "remove"), (os, "rmdir"), (os, "pwrite"),
              (shutil, "rmtree"), (safetensors.torch, "save_file"), (torch, "save"), (atomic, "_exchange")]


def config():
    return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.1,
                                   embd_pdrop=0.1, attn_pdrop=0.1)


def fresh():
    torch.manual_seed(0)
    model = om.AutoModelForCausalLM.from_config(config())
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))


def train(model, opt, steps) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def run_killed(save, kill_at: int, counter_file: str | None = None) -> bool:
    """Run ``save`` in a forked child killed just before step ``kill_at`` (-1: never; the step count is written to
    ``counter_file``). Returns whether the child was killed."""
    pid = os.fork()
    if pid == 0:  # child
        sites = []
        for module, name in STEP_CALLS:
            real = getattr(module, name)

            def step(*args, _real=real, _name=name, **kwargs):
                if len(sites) == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                caller = traceback.extract_stack(limit=2)[0]
                sites.append(f"{_name}@{os.path.basename(caller.filename)}:{caller.lineno}")
                return _real(*args, **kwargs)

            setattr(module, name, step)
        code = 0
        try:
            save()
        except BaseException as error:  # noqa: BLE001 - report, then leave without running atexit handlers
            print(f"save raised in the child: {error!r}", file=sys.stderr)
            code = 3
        if counter_file:
            with open(counter_file, "w") as handle:
                json.dump(sites, handle)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, f"the save failed in the child (kill_at={kill_at})"
    return False


def kill_points(save, work: str) -> tuple[list[int], int]:
    """The steps of one save to kill before, and their total. A run of calls from one line (DCP writing one tensor
    after another into the same file) is represented by its first and last call."""
    counter = os.path.join(work, "steps.json")
    run_killed(save, -1, counter)
    sites = json.load(open(counter))
    points = [i for i, site in enumerate(sites)
              if i == 0 or i == len(sites) - 1 or sites[i - 1] != site or sites[i + 1] != site]
    return points + [len(sites)], len(sites)


def hf_logits(folder: str) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(IDS).logits


def hub_sweep(work: str, exchange: bool) -> list[str]:
    old_model, opt = fresh()
    new_model, _ = fresh()
    train(new_model, torch.optim.AdamW(new_model.parameters(), lr=1e-2), [0])
    good = os.path.join(work, "hub-good")
    old_model.save_pretrained(good)
    with open(os.path.join(good, "tokenizer.json"), "w") as handle:
        handle.write("{}")
    new_ref = os.path.join(work, "hub-new")
    new_model.save_pretrained(new_ref)
    expected = {"old": hf_logits(good), "new": hf_logits(new_ref)}
    target = os.path.join(work, "hub")
    if not exchange:
        atomic._exchange = lambda a, b: False  # a kernel / file system without RENAME_EXCHANGE

    def reset():
        for entry in os.listdir(work):
            if entry == "hub" or entry.startswith(".hub."):
                shutil.rmtree(os.path.join(work, entry))
        shutil.copytree(good, target)

    reset()
    points, total = kill_points(lambda: new_model.save_pretrained(target), work)
    states = []
    for kill_at in points:
        reset()
        killed = run_killed(lambda: new_model.save_pretrained(target), kill_at)
        assert killed == (kill_at < total)
        if not exchange:
            atomic.recover_folder(target)  # the next save does this; plain transformers would need it done
        assert os.path.isfile(os.path.join(target, "config.json")), (kill_at, os.listdir(work))
        logits = hf_logits(target)
        state = next((name for name, value in expected.items() if torch.equal(logits, value)), None)
        assert state is not None, f"kill before step {kill_at}: the folder holds neither the old nor the new model"
        assert os.path.isfile(os.path.join(target, "tokenizer.json")), kill_at  # carried over, never lost
        if states and states[-1] == "new":
            assert state == "new", f"kill before step {kill_at}: the new model was published, then lost"
        states.append(state)
    new_model.save_pretrained(target)  # the next save clears what the killed ones left
    assert not [entry for entry in os.listdir(work) if entry.startswith(".hub.")], os.listdir(work)
    assert torch.equal(hf_logits(target), expected["new"])
    return states


def checkpoint_sweep(work: str) -> list[int]:
    reference, opt = fresh()
    torch.manual_seed(1)
    ref_losses = train(reference, opt, range(STEPS))
    ref_params = {k: v.detach().clone() for k, v in reference.named_parameters()}

    root, good = os.path.join(work, "ckpt"), os.path.join(work, "ckpt-good")
    model, opt = fresh()
    torch.manual_seed(1)
    train(model, opt, range(2))
    training.save_checkpoint(good, model, opt, step=2, extra={"losses": ref_losses[:2]})
    train(model, opt, range(2, 4))
    rng_at_4 = torch.get_rng_state()  # the parent's RNG moves on while it checks; each child saves this one

    def reset():
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(good, root)

    def save():
        torch.set_rng_state(rng_at_4)
        training.save_checkpoint(root, model, opt, step=4)

    reset()
    points, total = kill_points(save, work)
    resumed_at = []
    for kill_at in points:
        reset()
        killed = run_killed(save, kill_at)
        assert killed == (kill_at < total)
        resumed, resumed_opt = fresh()
        torch.manual_seed(12345)  # the RNG state must come from the checkpoint
        step = training.load_checkpoint(root, resumed, resumed_opt)["step"]
        assert step in (2, 4), step
        if resumed_at and resumed_at[-1] == 4:
            assert step == 4, f"kill before step {kill_at}: the step-4 checkpoint was published, then lost"
        losses = train(resumed, resumed_opt, range(step, STEPS))
        assert losses == ref_losses[step:], (kill_at, step, losses, ref_losses[step:])
        for name, param in resumed.named_parameters():
            assert torch.equal(param, ref_params[name]), (kill_at, step, name)
        resumed_at.append(step)
    return resumed_at


def main(work: str) -> None:
    summary = {"checkpoint": checkpoint_sweep(work), "hub": hub_sweep(work, exchange=True),
               "hub_two_renames": hub_sweep(work, exchange=False)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stderr.flush()
    os._exit(0)  # done and reported: no module teardown (~2 s of CPU, see fast_exit.py)
