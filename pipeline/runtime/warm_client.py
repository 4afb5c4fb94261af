"""The client of one command run by the warm server (`Client`): what this process sends the server
(its arguments, per-command environment, working directory, umask, signals and standard streams),
how it stands in for the fork meanwhile (signals passed on to its process group, Ctrl-Z), and how
it tells that the process at the other end is this user's, in these namespaces, and still alive.

Imports only the standard library: every stage's client is one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from pipeline.runtime.warm_address import CONNECT_TIMEOUT_S
from pipeline.runtime.warm_common import WARM_ENV, Refused, TimedOut, Unavailable, debugging
from pipeline.runtime.warm_key import per_command
from pipeline.runtime.warm_start import sponsor

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGWINCH)
START_TIMEOUT_S = 600  # the server's imports, on a machine busy with something else
READY_POLL_S = 0.5  # how often a client waiting for the server's imports looks whether it is stopped


class Client:
    """One command run by the server: what this process sends it, and how it stands in for the
    fork it runs the command in."""

    def __init__(self, address: str, key: str = "") -> None:
        self._key = key  # what this process would start a server for
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            self._sock.connect(address)
        except (TimeoutError, BlockingIOError):  # a Unix socket with a timeout says EAGAIN at once when full
            self._sock.close()
            raise Unavailable("the warm server's name takes no connection: its queue is full (another process "
                              "may hold it)") from None
        except OSError as exc:
            self._sock.close()
            raise Unavailable(f"no warm server ({exc.strerror})") from None
        self._sock.settimeout(None)
        # The pid of the process that last listened: the server itself, which listens again first thing.
        self._server_pid, uid, _ = peer_credentials(self._sock)
        if uid != os.getuid():  # someone else's process holds the name: send it nothing
            self._sock.close()
            raise Unavailable(f"the warm server's socket belongs to uid {uid}, not this user")
        # Nor to a process of this user in another container that shares this folder: it would get
        # this command's streams, and its exit code would be believed.
        # (Its pid is 0 here when it is in another PID namespace.)
        if not same_namespaces(self._server_pid):
            self._sock.close()
            raise Unavailable(f"the warm server's socket is held by a process in other namespaces (pid "
                              f"{self._server_pid} here)")
        self._pid: int | None = None
        self._pending: list[int] = []
        self._buffer = b""

    def run(self, argv: list[str]) -> int:
        """Run `argv` in a fork of the server; its exit code (negative: the signal that ended it).
        Unavailable: nothing ran, and nothing will."""
        # The server says it is ready once it has imported, and only then gets the command: a
        # client that gave up waiting has sent nothing, so nothing runs twice.
        ready = self._wait_ready()
        if not ready.get("ready"):
            raise Refused(ready.get("error", "the warm server is not ready"))
        self._server_pid = ready.get("pid", self._server_pid)  # not this process, if it listened first
        # What a fresh process would inherit from this one: the signals it ignores (nohup, a
        # background job of a script) and blocks stay so in the fork, and are not passed on.
        ignored = [int(sig) for sig in signal.Signals if signal.getsignal(sig) == signal.SIG_IGN]
        request = {"key": self._key, "sponsor": sponsor(), "argv": argv, "prog": program_name(), "cwd": os.getcwd(), "umask": current_umask(),
                   "path": sys.path, "env": {k: v for k, v in os.environ.items() if per_command(k)},
                   "ignored": ignored, "blocked": sorted(int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, []))}
        with stdio_fds() as fds:
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode() + b"\n"], fds)
            except OSError as exc:  # all of it or nothing: the server runs only a whole request
                raise Unavailable(f"the warm server took no command ({exc})") from None
        previous = {sig: signal.signal(sig, self._stop if sig == signal.SIGTSTP else self._forward)
                    for sig in (*FORWARDED, signal.SIGTSTP) if sig not in ignored}
        try:
            try:
                started = self._answer(None)
            except Unavailable:  # it may have forked before it went: never run the command a second time
                return self._lost(argv)
            if "pid" not in started:  # said before any fork: nothing ran
                raise Refused(started.get("error", "the warm server refused the command"))
            self._pid = started["pid"]
            if debugging():
                print(f"mnist-pipeline: runs in process {self._pid}, a fork of the warm server (process "
                      f"{self._server_pid})", file=sys.stderr)
            for sig in self._pending:
                self._forward(sig, None)
            try:
                return self._answer(None)["exit"]
            except Unavailable:
                return self._lost(argv)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _lost(self, argv: list[str]) -> int:
        """The server went away (killed, out of memory) while this command was its: the command
        itself runs on, its signals still passed on, and this waits for it; how it ended is lost
        with the server, so this fails and DVC runs the stage again next time."""
        where = f"in process {self._pid}" if self._pid else "before it said where"
        if self._pid is not None:
            try:
                with os.fdopen(os.pidfd_open(self._pid), "rb") as pidfd:
                    select.select([pidfd], [], [])
            except OSError:  # ended already
                pass
        print(f"mnist-pipeline: the warm server ended while `{' '.join(argv[1:])}` ran {where}, so how it ended "
              f"is not known; run it again (or set {WARM_ENV}=0 to run stages in processes of their own)",
              file=sys.stderr)
        return 1

    def _wait_ready(self) -> dict:
        """The server's word that it has imported: waited for while it imports (a busy machine may
        take minutes), but not from a server that is stopped (SIGSTOP, a debugger) or gone, which
        would never give it."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                return self._answer(min(READY_POLL_S, max(deadline - time.monotonic(), 0.01)))
            except TimedOut:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"no word from the warm server in {START_TIMEOUT_S} s") from None
                state = process_state(self._server_pid)
                if state in (None, "Z", "X"):
                    raise Unavailable(f"the warm server (process {self._server_pid}) is gone") from None
                if state in ("T", "t"):
                    raise Unavailable(f"the warm server (process {self._server_pid}) is stopped") from None

    def _answer(self, timeout: float | None) -> dict:
        self._sock.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self._sock.recv(4096)
            except TimeoutError:
                raise TimedOut("no answer from the warm server yet") from None
            except OSError as exc:
                raise Unavailable(f"no answer from the warm server ({exc})") from None
            if not chunk:
                raise Unavailable("the warm server closed the connection")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _forward(self, sig: int, frame) -> None:
        """As the terminal's signal would have reached the command in a process of its group."""
        if self._pid is None:
            self._pending.append(sig)
        else:
            signal_group(self._pid, sig)

    def _stop(self, sig: int, frame) -> None:
        """Ctrl-Z: the command stops, and so does this process, until SIGCONT (passed on too)."""
        self._forward(signal.SIGTSTP, frame)
        os.kill(os.getpid(), signal.SIGSTOP)


def signal_group(pid: int, sig: int) -> None:
    """`sig` to the process group a fork leads (the server makes it one before it tells the pid)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def program_name() -> str:
    """What click calls the program in its messages, as it would in this process."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name.endswith(".__main__"):  # python -m pipeline
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return os.path.basename(sys.argv[0])


def process_state(pid: int) -> str | None:
    """The state letter /proc gives process `pid` (R, S, T for stopped, Z, ...); None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def same_namespaces(pid: int) -> bool:
    """Whether process `pid` is where this one is: the same mount, network, UTS, IPC, PID, user and
    cgroup namespaces (a container, an emulated host, a sandbox is another)."""
    try:
        return pid > 0 and all(os.readlink(f"/proc/{pid}/ns/{kind}") == os.readlink(f"/proc/self/ns/{kind}")
                               for kind in ("mnt", "net", "uts", "ipc", "pid", "user", "cgroup"))
    except OSError:
        return False


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel vouches for them."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class stdio_fds:
    """This process's standard input, output and error for the fork (/dev/null for one that is closed)."""

    def __enter__(self) -> list[int]:
        self._opened = []
        fds = []
        for fd in (0, 1, 2):
            try:
                os.fstat(fd)
                fds.append(fd)
            except OSError:
                self._opened.append(os.open(os.devnull, os.O_RDWR))
                fds.append(self._opened[-1])
        return fds

    def __exit__(self, *exc) -> None:
        for fd in self._opened:
            os.close(fd)
