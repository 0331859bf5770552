"""A worker killed with SIGKILL under ``torchrun --max-restarts 1``: the group restarts, the example resumes by
itself from the newest complete checkpoint, and its losses equal the uninterrupted run's exactly; one job run as
two torchrun agents (``--nnodes 2``, loopback rendezvous). examples/train_clm.py, tiny GPT-2, 4 steps, a checkpoint
every 2.

- tp 2 x pp 2 x dp 2, ZeRO-1 (8 workers), 2D tp 4 x pp 2 (8 workers: the grid's weight blocks and each grid
  rank's dropout RNG), and cp 2 with ZeRO-3 (2 workers; FSDP shards over the dp x cp ranks, so the resume restores
  sharded parameters and optimizer state, each cp rank's RNG and the loader under context parallelism): the kill
  comes once step 4 is logged, during its save, so the first attempt logged the whole uninterrupted curve; the
  restart resumes at step 2 and recomputes steps 3 and 4.
- tp 2 x dp 2: a two-agent job (``--nnodes 2 --nproc_per_node 2``, ``--max-restarts 1`` on both) at ZeRO-2 whose
  rank 3 (second node) is killed once step 4 is logged: the first node's agent may restart its healthy workers as a
  membership change, which torchrun does not count (``TORCHELASTIC_RESTART_COUNT`` stays 0 there), yet rank 0 (on
  that node) reports elastic restart #1 and every rank resumes at step 2 in one world (the attempt is agreed on,
  ``distributed/context.py``). Its first attempt is the reference; a one-agent job at ZeRO-3 is killed at step 3
  and resumes at step 2. ZeRO-2 and ZeRO-3 run the same arithmetic (only when FSDP frees the gathered parameters
  differs), so every loss of both jobs' attempts and the final Hub folders equal bit for bit, and plain
  ``transformers`` loads them.

The negative control of the self-resume (a restart without it trains from scratch, silently) is in
``test_resume_decision.py``.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

import oslo_models as om
from tests.faults import launch
from tests.helpers import examples
from tests.helpers.dist import free_port

STEPS = 4
COMMON = (*examples.TINY, "--steps", str(STEPS), "--save-every", "2", "--report-to", "jsonl", "--collective-timeout",
          "120")


def _args(corpus, out, *layout):
    return launch.script("train_clm.py", *layout, "--data", corpus["data"], "--tokenizer", corpus["tokenizer"],
                         "--output", str(out), *COMMON)


def _resumed(outputs, attempts, latest_at_kill, resumed_at):
    """The restarted attempt resumed by itself at the step ``latest`` named when the worker died."""
    text = "\n".join(outputs)
    assert latest_at_kill == f"step-{resumed_at:08d}", latest_at_kill
    assert f"resumed at step {resumed_at} from" in text and "elastic restart #1" in text, text[-3000:]
    assert len(attempts) == 2 and sorted(attempts[1]) == list(range(resumed_at + 1, STEPS + 1)), attempts


# layout: (workers, options, rank killed, what rank 0 prints of its layout); one job each, killed after its last step
KILLED_AT_THE_END = {
    "tp2_pp2_dp2_zero1": (8, ("--tp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2"), 5,
                          "tp=0/2, dp=0/2, cp=0/1, ep=0/1, pp=0/2, sequence_parallel=False, device=cpu); zero_stage=1"),
    "tp4_2d_pp2": (8, ("--tp", "4", "--tp-mode", "2d", "--pp", "2", "--microbatches", "2"), 5,
                   "tp=0/4, dp=0/1, cp=0/1, ep=0/1, pp=0/2, sequence_parallel=False, device=cpu); zero_stage=0"),
    "cp2_zero3": (2, ("--cp", "2", "--zero", "3"), 1,
                  "tp=0/1, dp=0/1, cp=0/2, ep=0/1, pp=0/1, sequence_parallel=False, device=cpu); zero_stage=3"),
}


@pytest.mark.parametrize("layout", sorted(KILLED_AT_THE_END))
def test_elastic_restart_after_the_last_step(corpus, forkserver, tmp_path, layout):
    nproc, options, victim, printed = KILLED_AT_THE_END[layout]
    out = tmp_path / "out"
    command = launch.agent(nproc, restarts=1) + _args(corpus, out, *options)
    outputs, latest = launch.run([command], launch.environment(tmp_path, forkserver), tmp_path,
                                  kill=(out, STEPS, victim))
    assert "\n".join(outputs).count(printed) == 2, outputs[0][-3000:]  # both attempts at that layout
    attempts = launch.attempts(out)
    # the kill is meant to land inside step 4's save (latest: step 2); on a loaded box the poll can see step 4 only
    # after that save was published, and then the restart must resume at step 4 and train nothing more
    resumed_at = 4 if latest == f"step-{STEPS:08d}" else 2
    if resumed_at == STEPS:
        attempts.append({})  # the restarted attempt logged no step
    _resumed(outputs, attempts, latest, resumed_at)
    if "--tp-mode" in options:  # the repr above does not show the mode; the checkpoint's layout does
        assert "'tp_mode': '2d'" in "\n".join(outputs), outputs[0][-3000:]
    uninterrupted = attempts[0]
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    assert attempts[1] == {step: uninterrupted[step] for step in range(resumed_at + 1, STEPS + 1)}  # bit for bit
    report = json.loads((out / "loss.json").read_text())
    assert report["losses"] == [uninterrupted[step] for step in range(1, STEPS + 1)]


def test_two_nodes_zero2_and_elastic_restart_zero3(corpus, forkserver, tmp_path):
    env = launch.environment(tmp_path, forkserver)
    two = tmp_path / "two_nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    layout = ("--tp", "2", "--zero", "2")
    nodes = [launch.agent(2, restarts=1, nodes=2, endpoint=endpoint, host=host) + _args(corpus, two, *layout)
             for host in (True, False)]
    (two / "logs").mkdir(parents=True)
    outputs, latest = launch.run(nodes, env, two / "logs", kill=(two, STEPS, 3))
    text = "\n".join(outputs)
    assert text.count("ParallelContext(rank=0/4, tp=0/2, dp=0/2") == 2, text[-3000:]  # one world of 4, twice
    attempts = launch.attempts(two)
    _resumed(outputs, attempts, latest, 2)
    # each node's first local rank prints (Accelerate's local main process): both read the agreed restart count
    assert all("elastic restart #1" in output for output in outputs), [output[-2000:] for output in outputs]
    reference = attempts[0]
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert attempts[1] == {step: reference[step] for step in (3, 4)}  # bit for bit
    hub = two / "model"
    plain = transformers.AutoModelForCausalLM.from_pretrained(hub).eval()
    oslo = om.AutoModelForCausalLM.from_pretrained(str(hub), progress=False).eval()
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(oslo(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-4)
    assert json.loads((two / "loss.json").read_text())["losses"] == [reference[s] for s in range(1, STEPS + 1)]

    one = tmp_path / "zero3"
    (one / "logs").mkdir(parents=True)
    command = launch.agent(4, restarts=1) + _args(corpus, one, "--tp", "2", "--zero", "3")
    outputs, latest = launch.run([command], env, one / "logs", kill=(one, 3, 2))
    attempts = launch.attempts(one)
    _resumed(outputs, attempts, latest, 2)
    for attempt in attempts:
        assert attempt == {step: reference[step] for step in attempt}, (attempt, reference)
    assert json.loads((one / "loss.json").read_text())["losses"] == [reference[s] for s in range(1, STEPS + 1)]
    restarted, uninterrupted = load_file(one / "model" / "model.safetensors"), load_file(hub / "model.safetensors")
    assert restarted.keys() == uninterrupted.keys()
    assert all(torch.equal(restarted[key], uninterrupted[key]) for key in restarted)


def test_attempt_agreed_when_a_node_restarts_uncounted(monkeypatch):
    """The attempt prefix of the process group's keys: a node whose agent restarted its healthy workers as a
    membership change (restart count still 0) agrees with the node that counted the failure (1)."""
    from oslo_models.distributed.context import ATTEMPT_ENV, _attempt, elastic_attempt

    store = torch.distributed.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert [_attempt(store, rank) for rank in (0, 1)] == [0, 0]  # first attempt, both nodes
    assert _attempt(store, 0) == 1  # second attempt on the uncounted node (the restart count alone says 0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _attempt(store, 1) == 1 and elastic_attempt() == 1  # the node that counted it
    monkeypatch.delenv(ATTEMPT_ENV)
