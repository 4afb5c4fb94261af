"""How a stage's client starts the warm server (pipeline/runtime/warm_server.py) on its socket: the
folder's lock, the look for a server already listening, the server's command line, and the
processes it serves for (its sponsors: DVC, a script), which it outlives by moments only.

Imports only the standard library: every stage's client may start one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from pipeline.runtime.warm_address import CONNECT_TIMEOUT_S
from pipeline.runtime.warm_common import Unavailable
from pipeline.runtime.warm_key import read, unbuffered


def start_server(address: str, key: str, app: dict) -> None:
    """Bind the server's socket here (so a client can connect at once and wait while it imports),
    and start the server on it, in a session of its own, holding none of this process's files: a
    test or a CI step that reads this command's output to its end does not wait for the server.
    What it needs (its key, sys.path, who it serves) goes through a pipe, not its command line,
    which `ps` shows to every user."""
    try:
        with locked(address):
            if listening(address):  # another command started one a moment ago
                return
            launch(address, key, app)
    except OSError as exc:  # a full disk, no processes left for this user: the command runs here
        raise Unavailable(f"the warm server could not be started ({exc})") from None


def launch(address: str, key: str, app: dict) -> None:
    """Bind `address` (the lock held) and start the server on it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)  # a server killed outright leaves its socket's file behind
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener:
        listener.bind(address)
        listener.listen(16)
        config = {"key": key, "app": app, "path": [os.path.abspath(p) for p in sys.path], "address": address,
                  "inode": os.stat(address).st_ino, "sponsor": sponsor(), "listener": listener.fileno()}
        flags = subprocess._args_from_interpreter_flags()  # -X, -W, -O, ... as this interpreter has them
        if unbuffered():  # -u, which that list leaves out
            flags.append("-u")
        server = subprocess.Popen([sys.executable, *flags, "-c", SERVER_CODE, os.getcwd()], pass_fds=[listener.fileno()],
                                  start_new_session=True, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        with server.stdin:
            server.stdin.write(json.dumps(config).encode() + b"\n")


# The server's command line: what it is given comes on its standard input. (Its last argument,
# the folder it serves, leaves room for the name `ps` shows, warm_server.name_process.)
SERVER_CODE = ("import json, sys; config = json.loads(sys.stdin.readline()); sys.path[:] = config['path']; "
               "from pipeline.runtime.warm_server import serve; serve(config)()")


@contextlib.contextmanager
def locked(address: str) -> Iterator[None]:
    """The lock a server holds while it starts or removes its socket's file (one for the folder:
    held for moments, and no lock file left per key)."""
    fd = os.open(os.path.join(os.path.dirname(address), "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def listening(address: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(CONNECT_TIMEOUT_S)
        try:
            probe.connect(address)
        except (TimeoutError, BlockingIOError):
            return True  # held, if by no server that will answer: never removed from under it
        except OSError:
            return False
    return True


def sponsor() -> list[int] | None:
    """The process this command runs for (DVC, a queue's worker, a script; not the shell between):
    its pid and start time. A server ends soon after its sponsors all have."""
    pid = os.getppid()
    for _ in range(4):
        if read(f"/proc/{pid}/comm").strip() not in SHELLS:
            started = start_time(pid)
            return [pid, started] if started is not None else None
        pid = parent_pid(pid)
    return None


SHELLS = {"sh", "dash", "bash", "zsh", "ksh", "fish", "busybox"}


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot): with the pid, names one process for good."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def parent_pid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0
