"""``forkserver.py`` stands in for the program it forks: torchrun's agent sees the same arguments, environment,
working directory, output and exit status as from a fresh interpreter, a death by signal included (the elastic
tests' SIGKILL must reach the agent as exit code -9, or a restart could come from the other ranks' errors alone),
and the agent's SIGTERM reaches the program; under ``python -u`` its output is unbuffered. Each case is its own
negative control: a client that exits 0 or with another status, does not forward the signal or buffers the
output of a killed program fails it. And ``world.run`` fails on a failed or hung rank."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.faults import forkserver as forkserver_module
from tests.faults import launch, world

PROGRAM = """
import json, os, signal, sys, time
print(json.dumps([os.getcwd(), os.environ["FAULT_PROBE"], sys.argv[1:], os.getpid()]))  # before a SIGKILL: -u
what = sys.argv[1]
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "wait":
    time.sleep(60)
sys.exit(int(what))
"""


def test_forked_programs_exit_as_their_own(forkserver, tmp_path):
    if forkserver == "0":
        pytest.skip("OSLO_FAULT_FORKSERVER=0: fresh interpreters, nothing stands in for them")
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, FAULT_PROBE="probe", **{forkserver_module.ENV: forkserver})

    def start(what):
        # as torchrun starts its workers: `python -u`, so what a worker printed before its SIGKILL is there
        return subprocess.Popen([sys.executable, "-u", launch.FORKSERVER, str(script), what], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, text=True)

    for what, code in (("0", 0), ("3", 3), ("kill", -signal.SIGKILL)):
        client = start(what)
        out, _ = client.communicate(timeout=60)
        assert client.returncode == code, (what, client.returncode, out)
        cwd, probe, args, pid = json.loads(out)
        assert (cwd, probe, args) == (str(tmp_path), "probe", [what]), out
        assert pid == launch.forked(client.pid, forkserver) != client.pid  # the process the tests kill
    client = start("wait")
    assert client.stdout.readline()  # running
    client.send_signal(signal.SIGTERM)  # as the agent stops its workers: forwarded, and the program dies of it
    client.wait(timeout=60)
    assert client.returncode == -signal.SIGTERM, client.returncode


def _fails_on_rank1():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails on purpose")


def _hangs(seconds):
    time.sleep(seconds)


def test_forked_world_reports_a_failed_and_a_hung_rank(forkserver, tmp_path):
    """``world.run`` (the ranks of ``test_worlds.py``) fails the call with the failing rank's error, and a world
    that does not finish in time with every rank's stack, instead of passing."""
    if forkserver == "0":
        pytest.skip("OSLO_FAULT_FORKSERVER=0: a fresh rank imports longer than the 3 s this test lets it hang")
    world.run(forkserver, f"{__name__}:_hangs", 2, [0], timeout=60, log_dir=tmp_path)  # healthy: no error
    with pytest.raises(AssertionError, match=r"(?s)exit codes \[0, 1\].*ValueError: rank 1 fails on purpose"):
        world.run(forkserver, f"{__name__}:_fails_on_rank1", 2, [], timeout=60, log_dir=tmp_path)
    with pytest.raises(AssertionError, match=r"(?s)hung for 3 s.*--- rank 1.*in _hangs"):
        world.run(forkserver, f"{__name__}:_hangs", 2, [60], timeout=3, log_dir=tmp_path)
