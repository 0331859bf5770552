"""The example workers of the fault tests, forked from one process that has already imported torch.

    python tests/faults/forkserver.py SCRIPT ARGS...     # a worker: what torchrun's agent starts
    python tests/faults/forkserver.py --serve SOCKET     # the server (``launch.ForkServer`` starts it)

Why: every worker of an example (``torchrun ... train_clm.py``) spends ~8 s of CPU importing torch, transformers,
Accelerate and ``oslo_models`` before its first line, and the fault tests start some 40 of them (each elastic
restart starts the whole group again); on the 2-core CI box that import was two thirds of the fault group's time.

How: the command torchrun's agent starts is this file, which imports nothing heavy. With ``$OSLO_FAULT_FORKSERVER``
(the server's socket) set, it sends the server its standard streams (file descriptors over the Unix socket), its
environment, working directory and arguments; the server forks a child (the imports done, no thread started) that
takes them over, starts a new session as torchrun's own ``Popen(start_new_session=True)`` does, and runs the
example exactly as ``fast_exit.py`` does (``runpy`` as ``__main__``, its exit status). The client stands in for the
worker towards the agent: it forwards the signals the agent sends (SIGTERM, SIGINT, ...) and exits with the worker's
status, a signal death included (SIGKILL -> the agent sees exit code -9). A client that dies (the agent's SIGKILL)
has its worker killed by the server. ``launch.workers`` maps each client to its worker (the server writes
``SOCKET.pids/CLIENT_PID``), so the tests stop and kill the process that holds the worker's process groups.
Without ``$OSLO_FAULT_FORKSERVER`` (or with ``OSLO_FAULT_FORKSERVER=0`` for the tests) the client runs the program
in a fresh interpreter through ``fast_exit.py``, the same program as before.

Test machinery only, as ``dist_pool.py`` is for spawned ranks: the agent, its rendezvous and restarts are torchrun's
own, and each worker is its own process, killed with a real SIGKILL.
"""
from __future__ import annotations

import array
import io
import json
import os
import signal
import socket
import struct
import sys

ENV = "OSLO_FAULT_FORKSERVER"
HERE = os.path.dirname(os.path.abspath(__file__))
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# What an example worker imports before its first line; a module left out is imported by the worker (slower only).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor", "torch._dynamo", "transformers", "transformers.models.gpt2.modeling_gpt2",
           "transformers.activations", "transformers.generation", "accelerate", "accelerate.tracking", "tqdm.auto",
           "tokenizers", "numpy", "safetensors.torch", "oslo_models", "oslo_models.training", "oslo_models.cli",
           "oslo_models.generic", "oslo_models.training.layout_rules", "oslo_models.models.gpt2.modeling_gpt2",
           "oslo_models.data")


def _send(sock, payload: dict, fds=()) -> None:
    data = json.dumps(payload).encode()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([struct.pack("!I", len(data)), data], ancillary)


def _recv(sock) -> tuple[dict | None, list[int]]:
    fds = array.array("i")
    header, ancillary, _, _ = sock.recvmsg(4, socket.CMSG_SPACE(16 * fds.itemsize))
    if len(header) < 4:
        return None, []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    size = struct.unpack("!I", header)[0]
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None, list(fds)
        body += chunk
    return json.loads(body), list(fds)


def client(argv: list[str]) -> None:
    """Run ``argv`` in a forked worker and stand in for it (see the module docstring)."""
    address = os.environ.get(ENV)
    if not address or address == "0":
        os.execv(sys.executable, [sys.executable, os.path.join(HERE, "fast_exit.py"), *argv])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    streams = [[isinstance(stream.buffer, io.FileIO), stream.line_buffering] for stream in (sys.stdout, sys.stderr)]
    _send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "streams": streams}, fds=(0, 1, 2))
    reply, _ = _recv(sock)
    worker = reply["pid"]

    def forward(signum, frame):
        try:
            os.kill(worker, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    status, _ = _recv(sock)
    if status is None:
        sys.exit(f"forkserver.py: the server went away before worker {worker} ended")
    if status["signal"]:  # die the worker's death: the agent reads the same exit code (-9 for SIGKILL)
        if status["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    os._exit(status["code"])


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the worker the client describes, run it, leave with its status."""
    import random

    from tests.faults import fast_exit

    for signum in FORWARDED + (signal.SIGCHLD,):
        signal.signal(signum, signal.SIG_DFL)
    os.setsid()  # as torchrun's Popen(start_new_session=True)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fresh interpreter's seed, not the server's
    # the client's buffering (torchrun starts its workers with `python -u`: what a killed worker printed is there)
    sys.stdout, sys.stderr = (_text_stream(fd, like, *buffering)
                              for fd, like, buffering in zip((1, 2), (sys.stdout, sys.stderr), request["streams"]))
    os._exit(fast_exit.run_program(request["argv"]))


def _text_stream(fd: int, like, unbuffered: bool, line_buffering: bool):
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=like.encoding, errors=like.errors,
                            line_buffering=line_buffering, write_through=unbuffered)


def serve(address: str) -> None:
    """Import what the workers need, then fork one per client until the socket is removed or stdin closes."""
    import importlib
    import selectors
    import threading

    # fast_exit: what every child runs the program with; world: the ranks of test_worlds.py
    for name in ("tests.faults.fast_exit", "tests.faults.world", *PRELOAD):
        importlib.import_module(name)
    assert threading.active_count() == 1, f"threads after the imports: {threading.enumerate()} (fork is unsafe)"
    pids_dir = address + ".pids"
    os.makedirs(pids_dir, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen(64)
    os.rename(address + ".tmp", address)  # the clients connect once it is ready
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)  # closed by the test process: time to go
    clients: dict[int, tuple[socket.socket, int]] = {}  # worker pid -> (client connection, client pid)
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is sys.stdin:
                for pid, (conn, _) in clients.items():
                    conn.close()
                    _kill(pid)
                return
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _recv(conn)
                except OSError:  # the client died while sending (its agent killed it): nothing to start
                    request, fds = None, []
                if request is None:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                client_pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for other in [listener, conn, *(held for held, _ in clients.values())]:
                        other.close()
                    _child(request, fds)
                for fd in fds:
                    os.close(fd)
                with open(os.path.join(pids_dir, str(client_pid)), "w") as handle:
                    handle.write(str(pid))
                try:
                    _send(conn, {"pid": pid})
                except OSError:  # the client died before it learned its worker (the agent's SIGKILL, a restart
                    # under load): nobody stands in for that worker, so it goes too; the server must stay up
                    conn.close()
                    _kill(pid)
                    continue
                clients[pid] = (conn, client_pid)
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a client's connection readable: it died (it sends nothing more); kill its worker
                _kill(key.data)
        while True:  # reap workers, report their status to their clients
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn, _ = clients.pop(pid, (None, None))
            if conn is None:
                continue
            selector.unregister(conn)
            signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            try:
                _send(conn, {"signal": signum, "code": os.WEXITSTATUS(status) if not signum else 0})
            except OSError:
                pass
            conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
        os._exit(0)  # no module teardown (~2 s of CPU)
    else:
        client(sys.argv[1:])
