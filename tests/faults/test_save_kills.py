"""kill -9 at every step of both save paths: the last good checkpoint always loads, and resuming from it continues
bit-identically (see ``kill_driver.py``; one subprocess, forked by the fault tests' fork server, forks a child per
kill point)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.faults import forkserver as forkserver_module
from tests.faults import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the driver forks a child per kill point")
def test_kill_at_every_save_step(forkserver, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONWARNINGS="ignore",
               **{forkserver_module.ENV: forkserver})
    command = [sys.executable, launch.FORKSERVER, "-m", "tests.faults.kill_driver", str(tmp_path)]
    result = subprocess.run(command, env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    # Kills landed on both sides of the publishing step of every path, so both outcomes were checked.
    assert set(summary["checkpoint"]) == {2, 4} and len(summary["checkpoint"]) >= 8, summary
    for path in ("hub", "hub_two_renames"):
        assert set(summary[path]) == {"old", "new"} and len(summary[path]) >= 6, summary
