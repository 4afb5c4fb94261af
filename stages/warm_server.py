"""The warm server behind `mnist-pipeline` under DVC (stages/warm.py says why and when): it imports
what every stage needs, once, then forks one process per command and tells the command's client
how it ended.

Started by a client as `python -c ...`, with the listening socket the client bound; it ends after
`MNIST_PIPELINE_WARM_IDLE_S` (30 s) with no command running.

Safe to fork, on GPUs too: the server only imports. It never calls into CUDA (tests/test_warm.py
checks it as tests/test_forkserver.py checks the DDP fork server) and runs no Python thread (it
refuses to serve if an import started one), so each fork initialises CUDA, starts its threads and
seeds its generators as a fresh process would. The native threads some libraries start on import
(OpenBLAS's pool, jemalloc's background thread) are made for fork: both stop or lock at a fork.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Callable

from stages import warm

# Every stage's module, with what each imports on first use: a fork then starts with all of it.
PRELOAD = ("pipeline.tracking",  # first: its MLflow settings come before MLflow reads them
           "mlflow.store.tracking.sqlalchemy_store",  # the default store
           "torch._dynamo",  # torch.optim's first step and use_deterministic_algorithms import it
           "torch.distributed.elastic.multiprocessing",
           "stages.cli", "stages.prepare", "stages.commcheck", "stages.train", "stages.evaluate", "stages.compare",
           "stages.send_runs", "stages.rendezvous_check")
DEFAULT_IDLE_S = 30.0


def serve(listener_fd: int) -> Callable[[], None]:
    """The server's life. Returns only in a fork, with the command that fork is to run."""
    problem = preload()
    idle_s = float(os.environ.get(warm.IDLE_ENV) or DEFAULT_IDLE_S)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector through the pipe
    signal.set_wakeup_fd(wake_w)
    waiting: dict[socket.socket, None] = {}  # accepted, told ready, the command not received yet
    running: dict[int, socket.socket] = {}  # pid of a fork -> its client
    with socket.socket(fileno=listener_fd) as listener, selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        idle_since = time.monotonic()
        while True:
            timeout = None if (running or waiting) else idle_since + idle_s - time.monotonic()
            if timeout is not None and timeout <= 0:
                break
            for key, _ in selector.select(timeout):
                if key.fileobj is listener:
                    conn = accept(listener, problem)
                    if conn is not None:
                        waiting[conn] = None
                        selector.register(conn, selectors.EVENT_READ)
                elif key.fileobj == wake_r:
                    drain(wake_r)
                    for pid, code in reaped(running):
                        tell(running.pop(pid), {"exit": code}, selector)
                elif key.fileobj in waiting:
                    conn = key.fileobj
                    del waiting[conn]
                    request = receive(conn)
                    if request is None:  # the client gave up: nothing runs
                        selector.unregister(conn)
                        conn.close()
                        continue
                    pid = os.fork()
                    if pid == 0:  # the command's process: leave the server behind, as it is
                        signal.set_wakeup_fd(-1)
                        for sock in [*waiting, *running.values(), conn]:
                            sock.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        return lambda: warm.run_and_exit(lambda: run_command(*request))
                    for fd in request[1]:
                        os.close(fd)
                    running[pid] = conn
                    send(conn, {"pid": pid})
                else:  # a running command's client: it sends nothing more, so this is its end
                    conn = key.fileobj
                    pid = next(p for p, c in running.items() if c is conn)
                    if not conn.recv(1):  # killed outright: so is the command, as a fresh process would be
                        kill_group(pid)
                        selector.unregister(conn)
            if not running and not waiting:
                idle_since = time.monotonic() if idle_since is None else idle_since
            else:
                idle_since = None
    os._exit(0)


def preload() -> str | None:
    """Import everything; None if the server is fit to fork, else why not (told to each client,
    whose command then runs in its own process)."""
    try:
        from pipeline import malloc, plotting

        malloc.keep_freed_memory()  # as the CLI does first in every process
        for module in PRELOAD:
            importlib.import_module(module)
        plotting.pyplot()
        import torch

        if torch.cuda.is_initialized():
            return "CUDA was initialised while importing"
        if threading.active_count() != 1:
            return f"importing started Python threads: {threading.enumerate()}"
    except BaseException:
        return traceback.format_exc()
    return None


def accept(listener: socket.socket, problem: str | None) -> socket.socket | None:
    conn, _ = listener.accept()
    conn.setblocking(True)
    if warm.peer_uid(conn) != os.getuid():  # only its own user's commands run here
        conn.close()
        return None
    if not send(conn, {"error": f"the warm server cannot serve: {problem}"} if problem else {"ready": True}) \
            or problem:
        conn.close()
        return None
    return conn


def receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while data and not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            data += more
        if not data.endswith(b"\n") or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            return None
        return json.loads(data), fds
    except OSError:
        return None


def send(conn: socket.socket, message: dict) -> bool:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


def tell(conn: socket.socket, message: dict, selector: selectors.BaseSelector) -> None:
    send(conn, message)
    if conn.fileno() in selector.get_map():
        selector.unregister(conn)
    conn.close()


def drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def reaped(running: dict[int, socket.socket]) -> list[tuple[int, int]]:
    """(pid, exit code; negative for a signal) of each fork that ended."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid in running:
            done.append((pid, os.waitstatus_to_exitcode(status)))
    return done


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_command(request: dict, fds: list[int]) -> None:
    """In the fork: become the process `mnist-pipeline <argv>` would have been, then run it. Its
    end (exit code, traceback, exit handlers, a KeyboardInterrupt's signal) is the interpreter's
    own, as in a fresh process."""
    os.setsid()  # its own group, which the client signals as the terminal signals a foreground job
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for name in [name for name in os.environ if warm.per_command(name)]:
        del os.environ[name]
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    sys.argv = request["argv"]
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as Python sets it up for what fd 1 is
    if "numpy" in sys.modules:  # numpy's global generator, seeded from the OS in a fresh process
        sys.modules["numpy"].random.seed()
    warm.forked = True
    from stages import cli

    args = sys.argv[1:]
    if cli.launches_local_workers(args[0], args[1:]):
        from pipeline import forkserver

        forkserver.fork_here()  # now, while this process has run nothing
    cli.main(args=args, prog_name=request["prog"])
