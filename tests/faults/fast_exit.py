"""Run a program as ``__main__`` and leave with its exit status, skipping the interpreter's finalization.

    python tests/faults/fast_exit.py SCRIPT ARGS...          # as ``python SCRIPT ARGS...``
    python tests/faults/fast_exit.py -m MODULE ARGS...       # as ``python -m MODULE ARGS...`` (torchrun's agent)

Why: a process that imported torch, transformers and torch._dynamo spends about 2 s of CPU tearing its modules
down after ``main`` has returned (measured on the 2-core CI box), and the fault tests start some 50 such
processes (torchrun agents and workers, each forked from ``forkserver.py``, which runs them with
:func:`run_program`, or without a server started through this file). Everything the program does, its ``atexit``
handlers included, runs as
usual; only the module teardown after them is skipped, and the output streams are flushed before leaving.
Exit status: as Python's (``sys.exit(n)``, ``sys.exit("text")`` -> 1 with the text on stderr, an uncaught
exception -> 1 with its traceback on stderr).

Test machinery only: the examples' own exit path is what the other example tests run.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback


def run_program(argv: list[str]) -> int:
    """Run ``argv`` (``SCRIPT ARGS...`` or ``-m MODULE ARGS...``) as ``__main__``, then its ``atexit`` handlers;
    flush the output streams and return the exit status (the caller leaves with ``os._exit``)."""
    code = 0
    try:
        if argv[0] == "-m":
            module = argv[1]
            sys.argv = [module, *argv[2:]]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT`: its folder first
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the same status
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what a normal exit runs (trackers, logging handlers, torch's own)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: fast_exit.py SCRIPT ARGS... | -m MODULE ARGS...")
    os._exit(run_program(sys.argv[1:]))


if __name__ == "__main__":
    main()
