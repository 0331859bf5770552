"""Agreeing across ranks, so that one rank's failure is every rank's clear error instead of a hang.

Loading and saving are mostly rank-local work (each pipeline stage reads its own tensors, rank 0 writes the
files) between collectives. When that work fails on some ranks only, the others walk into the next collective
and wait there forever (or die with "Connection closed"). Two small primitives prevent it:

- :func:`agree_on_failure` (and the context manager :func:`all_or_none`): after the rank-local work, every rank
  joins **one** ``all_gather_object`` of ``(error message or None, value)``. If any rank failed, every rank
  raises the same exception, naming the first failing rank and its message (the failing rank chains its original
  traceback). It must run before any other collective, and every rank must reach it, so the work it guards must
  not itself run collectives.
- :func:`check_arrival`: a store-based barrier with a short timeout in front of a collective API (``save_pretrained``,
  ``save_checkpoint``). A rank that calls it alone (``if rank == 0: model.save_pretrained(...)``) gets a clear
  error naming the rule within ``timeout`` seconds instead of waiting in a gather for ranks that never come. It
  uses the rendezvous key-value store (TCPStore) of the default group, so it works with gloo and NCCL alike and
  never touches the device.

Both are no-ops in a single process.
"""
from __future__ import annotations

import builtins
import contextlib
import importlib
import os
import time

import torch.distributed as dist

ARRIVAL_TIMEOUT_ENV = "OSLO_ARRIVAL_TIMEOUT"
DEFAULT_ARRIVAL_TIMEOUT = 30.0
# How many times this rank passed check_arrival(what) in the current world. The counts belong to one default process
# group: a process that destroys its group and starts another (a restarted job in one interpreter, a notebook, a
# reused test process) starts counting from zero with its new peers, as they do.
_arrival_counts: dict[str, object] = {"world": None, "calls": {}}


def _arrival_calls() -> dict[str, int]:
    world = dist.group.WORLD
    if _arrival_counts["world"] is not world:
        _arrival_counts.update(world=world, calls={})
    return _arrival_counts["calls"]


class RankFailure(RuntimeError):
    """Raised on every rank when a rank failed with an exception type that cannot be rebuilt portably."""


def _describe(error: BaseException) -> str:
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return f"{type(error).__name__}: {text}"


def _distributed(context) -> bool:
    return context is not None and context.world_size > 1 and dist.is_available() and dist.is_initialized()


def agree_on_failure(context, error: BaseException | None, *, what: str, value=None, group=None) -> list:
    """One ``all_gather_object`` over the world of ``(this rank's error or None, value)`` (``group``: another
    process group spanning every rank, e.g. the one a background checkpoint writer uses).

    Returns every rank's ``value`` (rank order) when no rank failed. Otherwise raises on every rank the same
    exception: the first failing rank's type when it is a builtin like ``ValueError``/``FileNotFoundError``
    (``RankFailure`` otherwise), with the message ``"{what} failed on rank R: Type: message"``. Single process:
    re-raises ``error`` unchanged (or returns ``[value]``).
    """
    if not _distributed(context):
        if error is not None:
            raise error
        return [value]
    mine = None if error is None else (_lineage(type(error)), _describe(error), getattr(error, "errno", None))
    gathered: list = [None] * context.world_size
    dist.all_gather_object(gathered, (mine, value), group=group)
    failures = [(rank, item[0]) for rank, item in enumerate(gathered) if item[0] is not None]
    if not failures:
        return [item[1] for item in gathered]
    rank, (lineage, message, code) = failures[0]
    others = [r for r, _ in failures[1:]]
    text = f"{what} failed on rank {rank}: {message}"
    if others:
        text += f" (ranks {others} failed too)"
    raise rebuild_error(lineage, text, code) from error


def rebuild_error(lineage, text: str, code: int | None = None) -> BaseException:
    """The exception every rank raises for a failure of type ``lineage`` (see :func:`_rebuild`); an ``OSError``
    keeps its ``errno`` (``ENOSPC`` stays recognizable) while its message stays ``text``."""
    error = _rebuild(lineage)(text)
    if isinstance(error, OSError) and code is not None:
        error.errno = code
    return error


def _lineage(cls: type) -> list[tuple[str, str]]:
    """``(module, name)`` of an exception class and its bases, most derived first."""
    return [(base.__module__, base.__qualname__) for base in cls.__mro__]


def _rebuild(lineage) -> type:
    """The most derived class of ``lineage`` that every rank can rebuild: this project's own error classes
    (e.g. ``MismatchedSizeError``, a ``ValueError``) or the portable builtins; ``RankFailure`` otherwise. So a
    caller's ``except ValueError`` (or ``except ConnectionError``) catches the agreed error on every rank as it
    would the original."""
    for module, name in lineage:
        if module == "builtins":  # builtin exceptions take a message and exist on every rank
            found = getattr(builtins, name, None)
            if isinstance(found, type) and issubclass(found, Exception):
                return found
        if module.startswith("oslo_models.") and "." not in name:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and issubclass(found, BaseException):
                return found
    return RankFailure


@contextlib.contextmanager
def all_or_none(context, what: str, group=None):
    """Run the block on every rank; then :func:`agree_on_failure` (over ``group``): all ranks go on, or all raise
    the same error.

    The block must not run collectives itself (a rank that failed early would never reach them)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised on every rank below
        agree_on_failure(context, error, what=what, group=group)
        raise  # unreachable: agree_on_failure always raises when given an error
    agree_on_failure(context, None, what=what, group=group)


def arrival_timeout() -> float:
    """Seconds :func:`check_arrival` waits (``$OSLO_ARRIVAL_TIMEOUT``, default 30)."""
    raw = os.environ.get(ARRIVAL_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_ARRIVAL_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${ARRIVAL_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"${ARRIVAL_TIMEOUT_ENV}={raw!r} must be positive")
    return value


def check_arrival(context, what: str, rule: str, *, timeout: float | None = None) -> None:
    """Wait until every rank of the world has called ``check_arrival(…, what, …)`` as often as this one.

    Raises ``RuntimeError`` after ``timeout`` seconds (default :func:`arrival_timeout`) naming ``what``, the
    ranks that did not arrive and ``rule``. Uses the default group's key-value store: no collective runs, so a
    rank calling alone gets the error instead of hanging in the collective that follows.
    """
    if not _distributed(context):
        return
    store = _default_store()
    if store is None:  # no store to count on: fall back to gloo's own monitored barrier where there is one
        if dist.get_backend() == "gloo":
            import datetime

            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout or arrival_timeout()),
                                   wait_all_ranks=True)
        return
    timeout = arrival_timeout() if timeout is None else timeout
    calls = _arrival_calls()
    call = calls.get(what, 0)
    calls[what] = call + 1
    base = f"oslo_models/arrival/{what}/{call}"
    store.set(f"{base}/rank{context.rank}", b"1")
    count = store.add(base, 1)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while count < context.world_size:
        if time.monotonic() > deadline:
            arrived = [r for r in range(context.world_size) if store.check([f"{base}/rank{r}"])]
            missing = [r for r in range(context.world_size) if r not in arrived]
            # Withdraw, so that the next call on this rank meets the others' next call, not this one.
            store.add(base, -1)
            store.delete_key(f"{base}/rank{context.rank}")
            calls[what] = call
            raise RuntimeError(f"{what} is collective: {rule}. Rank {context.rank} waited {timeout:g} s but "
                               f"rank(s) {missing} of {context.world_size} never called it (call #{call + 1} on "
                               f"this rank). Raise ${ARRIVAL_TIMEOUT_ENV} if ranks are just slow to arrive.")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
        count = store.add(base, 0)


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - private API: fall back when it moves
        return None
