"""The warm server behind `mnist-pipeline` under DVC (pipeline/runtime/warm.py says why and when): it imports
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

import atexit
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from pipeline.runtime import warm_client, warm_common, warm_exit, warm_key, warm_start

DEFAULT_IDLE_S = 30.0
LINGER_S = 5.0  # once its sponsors ended: a script's next `dvc repro` in the same folder finds it


def serve(config: dict) -> Callable[[], None]:
    """The server's life (`config`: what warm_start.start_server says). Returns only in a fork, with the
    command that fork is to run."""
    listener_fd, own_key = config["listener"], config["key"]
    name_process(["mnist-pipeline", "warm-server", os.getcwd()])
    stdin = os.open(os.devnull, os.O_RDONLY)  # the pipe the config came through is done with
    os.dup2(stdin, 0)
    os.close(stdin)
    # Listening again makes this process the one the kernel names to each client that connects
    # (SO_PEERCRED), so a client waiting for the imports can see whether the server is stopped.
    relisten = socket.socket(fileno=listener_fd)
    relisten.listen(16)
    relisten.detach()
    app = config["app"]
    code = warm_key.code_digest(app["packages"])
    problem = preload(app["preload"])
    if problem is None and warm_key.code_digest(app["packages"]) != code:
        # An edit saved while this imported: what it imported may be neither the client's code
        # (its key) nor the code on disk now.
        problem = "the project's code changed while the server imported it\n"
    startup_path = list(sys.path)
    os.chdir("/")  # holds no folder of a project (a test's tmpfs can be unmounted under it)
    idle_s = float(os.environ.get(warm_common.IDLE_ENV) or DEFAULT_IDLE_S)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    stopping = []

    def stop(*_) -> None:  # SIGTERM: take no new command, let the running ones end as they would
        stopping.append(True)

    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector through the pipe
    signal.signal(signal.SIGTERM, stop)
    # No terminal is this server's: a signal to every process (a job's cgroup, `kill -- -1`) is
    # for the commands, which each get it too; the server outlives them to report how they ended.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.set_wakeup_fd(wake_w)
    waiting: set[socket.socket] = set()  # told ready, the command not received yet
    running: dict[socket.socket, int] = {}  # a running command's client -> its fork
    gone: set[socket.socket] = set()  # clients of running forks that went away (no longer selected)
    with socket.socket(fileno=listener_fd) as listener, selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        sponsors = Sponsors(selector)
        sponsors.add(config.get("sponsor"))
        idle_since = time.monotonic()
        while True:
            if stopping and listener.fileno() >= 0:
                selector.unregister(listener)
                listener.close()
            busy = bool(running or waiting)
            # Idle, it waits IDLE_ENV for a next command; a little while only once every process it
            # served for (the `dvc repro`) has ended.
            wait_s = LINGER_S if sponsors.all_gone() else idle_s
            if not busy and (stopping or time.monotonic() - idle_since >= wait_s):
                break
            timeout = None if busy or stopping else idle_since + wait_s - time.monotonic()
            for key, _ in selector.select(timeout):
                conn = key.fileobj
                if key.data is Sponsors:
                    sponsors.ended(conn)
                elif conn is listener:
                    conn = accept(listener, problem)
                    if conn is not None:
                        waiting.add(conn)
                        selector.register(conn, selectors.EVENT_READ)
                elif conn == wake_r:
                    drain(wake_r)
                    ended = reaped(set(running.values()))
                    for client in [c for c, pid in running.items() if pid in ended]:
                        send(client, {"exit": ended[running.pop(client)]})
                        if client in gone:  # its end was seen already, and its fork killed
                            gone.discard(client)
                        else:
                            selector.unregister(client)
                        client.close()
                elif conn in waiting:
                    waiting.discard(conn)
                    request = receive(conn, startup_path, own_key)
                    if isinstance(request, tuple):
                        sponsors.add(request[0].get("sponsor"))
                    pid = fork(conn, request) if isinstance(request, tuple) else None
                    if pid == 0:  # the command's process: leave the server behind, as it is
                        signal.set_wakeup_fd(-1)
                        for sock in [*waiting, *running, conn]:
                            sock.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        return lambda: warm_exit.run_and_exit(lambda: run_command(*request, app["run_in_fork"]))
                    if pid is None:  # nothing runs: the client is told why, if it still listens
                        if isinstance(request, str):
                            send(conn, {"error": request})
                        selector.unregister(conn)
                        conn.close()
                    else:
                        running[conn] = pid
                        send(conn, {"pid": pid})
                elif conn in running:  # it sends nothing more: readable means the client is gone
                    try:
                        hung_up = not conn.recv(1)
                    except OSError:
                        hung_up = True
                    if hung_up:  # killed outright: so is its command, as a process of its own would be
                        warm_client.signal_group(running[conn], signal.SIGKILL)
                        selector.unregister(conn)
                        gone.add(conn)  # reaped like any fork, on its SIGCHLD
            if busy or running or waiting:  # idle from the moment the last command ended, not from when it began
                idle_since = time.monotonic()
        remove_own_file(config["address"], config["inode"])
    sys.stdout.flush()
    atexit._run_exitfuncs()  # what the imports registered for the server's own files (matplotlib's cache)
    os._exit(0)


def fork(conn: socket.socket, request: tuple[dict, list[int]]) -> int | None:
    """Fork for `request`: 0 in the fork, its pid here, None if it could not be forked. The fork
    leads a process group of its own from the moment its pid is known: a signal the client passes
    on at once reaches it."""
    sys.stdout.flush()  # nothing the server buffered is written again by the fork
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in request[1]:
            os.close(fd)
        send(conn, {"error": f"the warm server could not fork ({exc})"})
        return None
    try:
        os.setpgid(pid, 0)  # both sides, as a shell does: whichever runs first makes the group
    except OSError:
        pass
    if pid:
        for fd in request[1]:
            os.close(fd)
    return pid


def preload(modules: list[str]) -> str | None:
    """Import everything (`modules`, then matplotlib's pyplot); None if the server is fit to fork,
    else why not (told to each client, whose command then runs in its own process)."""
    try:
        from pipeline import malloc, plotting
        from pipeline.runtime import driver

        malloc.keep_freed_memory()  # as the CLI does first in every process
        for module in modules:
            importlib.import_module(module)
        plotting.pyplot()
        import torch

        # torch.cuda.is_available() initialises the driver without torch.cuda.is_initialized()
        # saying so; the driver, asked, does (loaded alone, as `import torch` loads it, is fine).
        touched = driver.initialised()
        if torch.cuda.is_initialized() or touched:
            return (f"the NVIDIA driver was initialised while importing ({', '.join(touched) or 'torch.cuda'}), "
                    "and a fork of it could not use the GPUs")
        if threading.active_count() != 1:
            return f"importing started Python threads: {threading.enumerate()}"
    except BaseException:
        return traceback.format_exc()
    return None


def accept(listener: socket.socket, problem: str | None) -> socket.socket | None:
    conn, _ = listener.accept()
    conn.setblocking(True)
    pid, uid, _ = warm_client.peer_credentials(conn)
    # Only its own user's commands, from where the server itself runs: the name of an abstract
    # socket can be read in /proc/net/unix from another container or sandbox of the same user.
    if uid != os.getuid() or not warm_client.same_namespaces(pid):
        conn.close()
        return None
    if not send(conn, {"error": f"the warm server cannot serve: {problem.strip().splitlines()[-1]}"} if problem
                else {"ready": True, "pid": os.getpid()}) \
            or problem:
        conn.close()
        return None
    return conn


class Sponsors:
    """The processes the server's commands ran for (warm_start.sponsor), each watched through a pidfd
    that becomes readable when it ends."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self._selector = selector
        self._watched: dict[int, int] = {}  # pid -> pidfd
        self._seen = False

    def add(self, sponsor: list[int] | None) -> None:
        if not sponsor or sponsor[0] in self._watched:
            return
        pid, started = sponsor
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # ended already (or no pidfds here): nothing to wait for
            return
        if warm_start.start_time(pid) != started:  # the pid names another process now
            os.close(pidfd)
            return
        self._watched[pid] = pidfd
        self._seen = True
        self._selector.register(pidfd, selectors.EVENT_READ, Sponsors)

    def ended(self, pidfd: int) -> None:
        self._selector.unregister(pidfd)
        os.close(pidfd)
        self._watched = {pid: fd for pid, fd in self._watched.items() if fd != pidfd}

    def all_gone(self) -> bool:
        return self._seen and not self._watched


def remove_own_file(address: str, inode: int) -> None:
    """Remove the socket's file, unless another server's has replaced it (warm_start.start_server)."""
    with warm_start.locked(address):
        try:
            if os.stat(address).st_ino == inode:
                os.unlink(address)
        except FileNotFoundError:
            pass


def receive(conn: socket.socket, startup_path: list[str], own_key: str) -> tuple[dict, list[int]] | str | None:
    """The client's command and its standard streams; a reason it cannot run here; or None if the
    client gave up before it sent one. A client whose own key is not this server's (its environment
    differs: a stripped one, or another Python) gets no fork of this one."""
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while data and not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            data += more
        request = json.loads(data) if data.endswith(b"\n") and len(fds) == 3 else None
    except (OSError, ValueError):
        request = None
    if request is not None and request.get("key") != own_key:
        request = "the client's key is not this server's: its environment or code differs"
    elif request is not None and [os.path.abspath(p) for p in request["path"]] != startup_path:
        request = "the client's sys.path is not the one the server imported with"
    if not isinstance(request, dict):
        for fd in fds:
            os.close(fd)
        return request
    # Only what names the command: all else the server was started with, as its key says.
    request["env"] = {k: v for k, v in request["env"].items() if warm_key.per_command(k)}
    return request, fds


def send(conn: socket.socket, message: dict) -> bool:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


def drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def reaped(forks: set[int]) -> dict[int, int]:
    """pid -> exit code (negative: the signal) of each of `forks` that ended."""
    done = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid in forks:
            done[pid] = os.waitstatus_to_exitcode(status)
    return done


def run_command(request: dict, fds: list[int], run_in_fork: str) -> None:
    """In the fork: become the process `mnist-pipeline <argv>` would have been, then run it. Its
    end (exit code, traceback, exit handlers, a KeyboardInterrupt's signal) is the interpreter's
    own, as in a fresh process."""
    os.setpgid(0, 0)  # its own group (the server made it too), which the client signals as a terminal would
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    # Signals as Python starts a process with the client's: SIGINT raises KeyboardInterrupt unless
    # it was ignored, and what the client ignores or blocks (nohup's SIGHUP) stays so.
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.SIGHUP not in request["ignored"]:
        signal.signal(signal.SIGHUP, hang_up)
    for sig in request["ignored"]:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    name_process(["mnist-pipeline", *request["argv"][1:]])
    # Exit handlers that remove what the server made for itself (matplotlib's cache folder, when
    # its own is not writable) are the server's: the first fork to end would remove it from all.
    atexit.unregister(shutil.rmtree)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for name in [name for name in os.environ if warm_key.per_command(name)]:
        del os.environ[name]
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    sys.argv = request["argv"]
    # As Python sets it up for what fd 1 is, and for -u (the server has the client's -u).
    sys.stdout.reconfigure(line_buffering=os.isatty(1), write_through=warm_key.unbuffered())
    if "numpy" in sys.modules:  # numpy's global generator, seeded from the OS in a fresh process
        sys.modules["numpy"].random.seed()
    warm_common.named(run_in_fork)(sys.argv[1:], request["prog"])


def hang_up(signum: int, frame) -> None:
    """SIGHUP in a fork: its client's terminal hung up, or the server died while the command was
    stopped (Ctrl-Z), and the kernel hangs up the orphaned process group. Either way the command
    ends as SIGTERM ends it, its runs FAILED, not killed where it stands (and where SIGTERM would
    kill it, SIGHUP does)."""
    handler = signal.getsignal(signal.SIGTERM)
    if handler is signal.SIG_IGN:  # ending already (pipeline.runtime.lifecycle): let the cleanup finish
        return
    if callable(handler):
        handler(signal.SIGTERM, frame)
        return
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGHUP)


def name_process(args: list[str]) -> None:
    """What `ps`, `pgrep -f`, top and nvidia-smi show for this process: `args`, written over the
    command line the process started with (as setproctitle does; as long as it fits), and its
    short name (prctl PR_SET_NAME, what `ps -o comm` and the OOM killer's report say)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, ctypes.c_char_p(args[0].encode()[:15]), 0, 0, 0)
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
        title = "\0".join(args).encode(errors="replace")[:end - start - 1]
        ctypes.memmove(start, title + b"\0" * (end - start - len(title)), end - start)
    except (OSError, AttributeError, ValueError, IndexError):
        pass
