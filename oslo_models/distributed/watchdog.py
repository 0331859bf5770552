"""A rank that stops participating becomes every waiting rank's clear error, never a silent hang.

When one rank hangs (a deadlock in user code, a stuck storage read, ``SIGSTOP``, a dead host), the others wait in
their next collective: NCCL's default timeout is 10 minutes, gloo's 30, and the error they finally raise (gloo:
"Timed out waiting 1800000ms for recv operation to complete") names neither the collective, nor the group, nor the
rank that never came. ``ParallelConfig.collective_timeout`` (seconds, default 600) fixes both:

- every process group a ``ParallelContext`` creates (and the default group) gets the backend timeout
  ``collective_timeout + grace``, so a stuck collective raises in the calling thread instead of waiting 30 minutes;
- one :class:`Watchdog` thread per process publishes a *heartbeat* to the rendezvous key-value store every
  ``interval`` seconds (``collective_timeout / 8``, between 0.25 and 15 s): the time, this rank's progress on every
  group (the number of collectives it has entered, from torch's flight recorder) and the collective it waits in.
  When a collective of this rank (``all_reduce``, ``all_gather``, ``broadcast``, ``barrier``, ... as torch's flight
  recorder records them; FSDP's and DCP's included) has waited ``collective_timeout`` seconds, the watchdog reads
  the heartbeats of the group's other ranks and names the missing ones: a rank whose heartbeat stopped (stopped,
  hung in native code, or dead) or a rank that is alive but never entered the collective (and what it waits in
  instead). It prints that report to stderr and keeps it (:func:`timeout_report`); the backend raises ``grace``
  seconds later in the main thread, and ``CollectiveTimeoutError`` (:func:`raise_for_timeout`) carries the
  report. If the collective belongs to a group whose backend timeout is longer (one created elsewhere, not given
  this timeout) and it is still stuck ``grace`` seconds after that, the watchdog ends the process (exit status 1),
  as NCCL's own watchdog does: never a silent hang.

The store is the launcher's (torchrun's agent hosts it; without torchrun, rank 0's process does, so a stopped rank 0
also stops the store: launch with torchrun). Point-to-point transfers (pipeline send/recv) are not in the flight
recorder: a stuck one fails at the backend timeout, and :func:`raise_for_timeout` names the ranks whose heartbeat
stopped. Costs: a few hundred bytes written to the store every ``interval`` seconds and one flight-recorder dump.

One watchdog per process (like torch's own registry of process groups); the newest ``ParallelContext`` sets its
timeout.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

_KEY = "oslo_models/watchdog/attempt{attempt}/rank{rank}"
_PROCESS: dict[str, "Watchdog"] = {}  # at most one watchdog per process, under "watchdog"


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than ``ParallelConfig.collective_timeout`` for a rank that never came."""


def interval_for(timeout: float) -> float:
    """Seconds between two heartbeats (and two checks) for ``timeout``."""
    return min(max(timeout / 8.0, 0.25), 15.0)


def grace_for(timeout: float) -> float:
    """Seconds between the watchdog's report and the backend's own timeout (room to diagnose and print)."""
    return 2.0 * interval_for(timeout) + 1.0


def _flight_recorder(entries: bool) -> dict:
    """torch's flight recorder of this process (``{}`` where this torch has none)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        return {}
    try:
        return json.loads(_dump_fr_trace_json(entries, True))
    except Exception:  # noqa: BLE001 - a diagnostic aid must never break training
        return {}


def _op_name(entry: dict) -> str:
    return str(entry.get("profiling_name", "collective")).split(":")[-1]


class Watchdog:
    """Heartbeats and stuck-collective reports of one process (see the module docstring). Thread-safe reads."""

    def __init__(self, store, rank: int, world_size: int, timeout: float, *, attempt: int = 0, stream=None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.attempt = attempt
        self.stream = stream if stream is not None else sys.stderr
        self.groups: dict[str, tuple[str, tuple[int, ...]]] = {}  # pg name -> (label, global ranks)
        self.report: str | None = None
        self.world_group = dist.group.WORLD  # the default group this watchdog belongs to (a new one: a new watchdog)
        self._complained = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.set_timeout(timeout)

    # ------------------------------------------------------------------ configuration
    def set_timeout(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self.interval = interval_for(self.timeout)
        self.grace = grace_for(self.timeout)
        self.stale_after = 3.0 * self.interval + 0.5

    def watch_group(self, group, label: str) -> None:
        """Name ``group`` ``label`` in reports and give it the backend timeout ``collective_timeout + grace``."""
        if group is None:
            return
        name = group.group_name
        with self._lock:
            if name not in self.groups:
                self.groups[name] = (label, tuple(dist.get_process_group_ranks(group)))
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=self.timeout + self.grace), group)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self.beat()  # one heartbeat before any collective of this context, so peers always find one
        self._thread = threading.Thread(target=self._run, name="oslo-collective-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)

    def _run(self) -> None:
        reported_at = None
        while not self._stop.wait(self.interval):
            if not dist.is_initialized() or dist.group.WORLD is not self.world_group:
                return  # the default group was destroyed (and maybe another one made): this watchdog is done
            try:
                stuck = self.beat()
                if stuck is None:
                    reported_at = None
                    continue
                age = time.time() - stuck["time_created_ns"] / 1e9
                if age < self.timeout:
                    continue
                if reported_at is None:
                    report = self.diagnose(stuck, age)
                    with self._lock:
                        self.report = report
                    print(f"[oslo_models watchdog] {report}", file=self.stream, flush=True)
                    reported_at = time.monotonic()
                elif (time.monotonic() - reported_at > 2 * self.grace
                      and stuck.get("timeout_ms", 0) > 1000 * (self.timeout + self.grace)):
                    # a group with a longer backend timeout than ours (one this module did not set): do not hang
                    print(f"[oslo_models watchdog] rank {self.rank} is still stuck {2 * self.grace:.0f} s after the "
                          "report above; ending the process (exit status 1)", file=self.stream, flush=True)
                    os._exit(1)
            except Exception as error:  # noqa: BLE001 - never take training down for a diagnostic
                if not self._complained:  # once: a store that went away would repeat it every interval
                    self._complained = True
                    print(f"[oslo_models watchdog] rank {self.rank}: heartbeat failed ({error!r}); retrying "
                          "quietly", file=self.stream, flush=True)

    # ------------------------------------------------------------------ heartbeats
    def _key(self, rank: int) -> str:
        return _KEY.format(attempt=self.attempt, rank=rank)

    def _label(self, pg_name: str, desc: str = "") -> tuple[str, tuple[int, ...]]:
        with self._lock:
            known = self.groups.get(pg_name)
        if known is not None:
            return known
        ranks: tuple[int, ...] = ()
        try:
            from torch.distributed.distributed_c10d import _resolve_process_group

            ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(pg_name)))
        except Exception:  # noqa: BLE001 - a group this process does not know by name
            pass
        label = "world" if desc == "default_pg" else (desc[len("mesh_"):] if desc.startswith("mesh_") else desc)
        return label or pg_name, ranks

    def beat(self) -> dict | None:
        """Publish this rank's heartbeat; return its oldest collective still in flight (a flight-recorder entry)."""
        record = _flight_recorder(entries=True)
        waiting = [entry for entry in record.get("entries", []) if not entry.get("retired", True)]
        stuck = min(waiting, key=lambda entry: entry["time_created_ns"]) if waiting else None
        enqueued = {name: int(status.get("last_enqueued_collective", -1))
                    for name, status in record.get("pg_status", {}).items()}
        state = {"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(), "enqueued": enqueued}
        if stuck is not None:
            name, desc = (list(stuck.get("process_group", [])) + ["", ""])[:2]
            label, ranks = self._label(name, desc)
            state["waiting"] = {"op": _op_name(stuck), "seq": stuck.get("collective_seq_id"), "group": label,
                                "ranks": list(ranks), "since": stuck["time_created_ns"] / 1e9}
        self.store.set(self._key(self.rank), json.dumps(state))
        return stuck

    def heartbeat_of(self, rank: int) -> dict | None:
        key = self._key(rank)
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception:  # noqa: BLE001 - the store itself may be gone
            return None

    # ------------------------------------------------------------------ reports
    def _describe_peer(self, rank: int, pg_name: str, seq: int, now: float) -> str | None:
        """Why ``rank`` is missing from collective ``seq`` of group ``pg_name`` (``None``: it entered it)."""
        beat = self.heartbeat_of(rank)
        if beat is None:
            return f"rank {rank} (never sent a heartbeat: it did not start, or its watchdog is off)"
        silent = now - beat["time"]
        where = f" on {beat.get('host', '?')} pid {beat.get('pid', '?')}"
        if silent > self.stale_after:
            return f"rank {rank}{where} (no heartbeat for {silent:.1f} s: stopped, hung in native code, or dead)"
        entered = beat.get("enqueued", {}).get(pg_name, -1)
        if seq is not None and entered >= seq:
            return None
        text = f"rank {rank}{where} (alive, but has not entered it"
        other = beat.get("waiting")
        if other:
            text += (f": it waits in {other['op']} #{other['seq']} of group '{other['group']}' "
                     f"(ranks {other['ranks']}) since {now - other['since']:.1f} s")
        return text + ")"

    def diagnose(self, entry: dict, age: float) -> str:
        """The report for flight-recorder ``entry`` of this rank, waiting ``age`` seconds."""
        name, desc = (list(entry.get("process_group", [])) + ["", ""])[:2]
        label, ranks = self._label(name, desc)
        seq = entry.get("collective_seq_id")
        now = time.time()
        missing = [text for rank in ranks if rank != self.rank
                   for text in [self._describe_peer(rank, name, seq, now)] if text]
        head = (f"collective timeout: rank {self.rank} waited {age:.1f} s in {_op_name(entry)} #{seq} of process "
                f"group '{label}' (ranks {list(ranks)})")
        if missing:
            body = "; missing: " + "; ".join(missing)
        else:
            body = "; every rank of the group entered it: the transport itself is stuck"
        return (f"{head}{body}. ParallelConfig.collective_timeout={self.timeout:g} s "
                f"(examples: --collective-timeout)")

    def stale_ranks(self) -> list[str]:
        """Descriptions of every other rank whose heartbeat stopped (a post-mortem without a flight record)."""
        now = time.time()
        found = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            beat = self.heartbeat_of(rank)
            if beat is None:
                found.append(f"rank {rank} (no heartbeat)")
            elif now - beat["time"] > self.stale_after:
                found.append(f"rank {rank} on {beat.get('host', '?')} pid {beat.get('pid', '?')} (no heartbeat for "
                             f"{now - beat['time']:.1f} s: stopped, hung in native code, or dead)")
        return found


# ---------------------------------------------------------------------------------------------- process level
def _own_store(timeout: float):
    """A separate client of the rendezvous store (its own short timeout: a dead store never blocks the watchdog
    for long), or the default group's store where it is not a TCPStore."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        try:
            return dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=max(5.0, 2 * interval_for(timeout))))
        except Exception:  # noqa: BLE001 - fall back to the shared client
            pass
    return store


def ensure_watchdog(rank: int, world_size: int, timeout: float) -> Watchdog:
    """The process's watchdog (started on first use) with ``timeout``; it watches the default group."""
    watchdog = _PROCESS.get("watchdog")
    if watchdog is not None and watchdog.world_group is not dist.group.WORLD:
        watchdog.stop()  # it watched a default group that has since been destroyed
    if watchdog is None or watchdog._stop.is_set():
        from .context import elastic_attempt  # every rank's agreed attempt: the process group's key prefix too

        watchdog = Watchdog(_own_store(timeout), rank, world_size, timeout, attempt=elastic_attempt())
        _PROCESS["watchdog"] = watchdog
        atexit.register(watchdog._stop.set)  # no join at exit: a store that is already gone must not delay it
    else:
        watchdog.set_timeout(timeout)
    watchdog.watch_group(dist.group.WORLD, "world")
    watchdog.start()
    return watchdog


def current_watchdog() -> Watchdog | None:
    return _PROCESS.get("watchdog")


def timeout_report() -> str | None:
    """The report of this process's watchdog, when a collective timed out (else ``None``)."""
    watchdog = current_watchdog()
    return None if watchdog is None else watchdog.report


def raise_for_timeout(error: BaseException) -> None:
    """Re-raise ``error`` (a backend error out of a collective) as :class:`CollectiveTimeoutError` with the
    watchdog's report; without one, name the ranks whose heartbeat stopped. Returns (does nothing) when ``error``
    is not a distributed failure or there is nothing to add."""
    if isinstance(error, CollectiveTimeoutError) or not isinstance(error, RuntimeError):
        return
    watchdog = current_watchdog()
    if watchdog is None:
        return
    report = watchdog.report
    if report is None:
        text = str(error)
        if not any(marker in text for marker in ("Timed out", "timed out", "Connection closed", "Connection reset")):
            return
        stale = watchdog.stale_ranks()
        if not stale:
            return
        report = (f"a collective of rank {watchdog.rank} failed ({text.splitlines()[0][:200]}); ranks that stopped "
                  f"responding: {'; '.join(stale)}")
    raise CollectiveTimeoutError(report) from error
