"""`mnist-pipeline`'s entry point: under DVC, each stage runs as a fork of one warm server that
imported torch, MLflow and every stage's code once for the whole `dvc repro`.

Each stage is a process of its own, and each used to import the heavy libraries it needed before
any work (torch, MLflow with its SQL store, torch._dynamo, matplotlib: benchmarks/
pipeline_overhead.py times each) and to tear them down after it. Now the first stage that needs
them starts the server (pipeline/runtime/warm_server.py), and every later `mnist-pipeline` command is a
small client: it sends the server its arguments, the environment variables that name the DVC
stage, its working directory and umask, the signals it ignores and blocks, and its standard input,
output and error; the server forks, and the fork runs the command as `mnist-pipeline` would have
in a fresh process. The client stays in the foreground the whole time: it passes the signals a
terminal, `timeout`, a container or a scheduler send (FORWARDED, and Ctrl-Z) on to the fork's
process group, and exits as the fork did, with its exit code or by its signal. A client killed
outright takes the fork with it.

A fork is only as good as a fresh process if nothing the stages read at start-up differs. The
server is therefore keyed (`server_key`) by the Python (its flags, -u, warning and -X options, path),
the working directory, the project's code, the installed distributions and .pth files, matplotlib's
config files, every environment variable but DVC's own `DVC_*` and the shell's `PWD`, `OLDPWD`,
`SHLVL` and `_` (passed to the fork instead), the user, the host name, the namespaces (a container,
an emulated host), the cgroup, the CPUs, the priority and the limits. Anything else starts a
server of its own. A server ends a few seconds after the processes it served for (the `dvc
repro`) have, or after `IDLE_ENV` (30 s) idle. Its socket is a file in a folder only its user can
enter (`private_folder`), named through a secret kept there. Only the user who started a server,
from the same namespaces, can reach it; a client believes only a process of its user in its
namespaces, and a name that takes no connection is passed over at once. The server forks only
for a client whose key is its own, and serves nobody if the project's code changed while it
imported (the client's key named the code before).
Where the key cannot be computed, or no server can be had, the command runs in its own process. What still differs from a fresh process: the fork's parent is
the server, it has no controlling terminal, and it shares the server's string-hash seed.

On by default under DVC (DVC_STAGE set), on Linux, and never for a worker an outer launcher
started (torchrun, Slurm, Kubeflow: RANK set): `MNIST_PIPELINE_WARM=0` turns it off, `=1` on for
commands run by hand too. Where no server can be had, the command runs in this process, as before
(`MNIST_PIPELINE_DEBUG=1` says why).

Imports only the standard library: this is what every stage's client pays.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable, Iterator, NoReturn

WARM_ENV = "MNIST_PIPELINE_WARM"  # 0: never; 1: for every command; unset: under DVC only
IDLE_ENV = "MNIST_PIPELINE_WARM_IDLE_S"  # how long a server with nothing to run stays (default 30)
PROTOCOL = 1
# Named by the stage, not by what a fresh process reads: no part of the server's key.
PER_COMMAND_ENV = ("PWD", "OLDPWD", "SHLVL", "_")
PER_COMMAND_PREFIX = "DVC_"
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGWINCH)
START_TIMEOUT_S = 600  # the server's imports, on a machine busy with something else
# A server accepts at once, even while it imports; a name whose queue is full (another user's
# process took it after our server's idle exit, and accepts nothing) would block connect() forever.
# With a timeout, the kernel answers a full queue of a Unix socket at once (EAGAIN).
CONNECT_TIMEOUT_S = 5
READY_POLL_S = 0.5  # how often a client waiting for the server's imports looks whether it is stopped


class Unavailable(Exception):
    """No server to be had; the command runs in this process."""


class TimedOut(Unavailable):
    """No answer within the time asked for."""


class Refused(Unavailable):
    """The server said it cannot run commands (an import failed, or made it unfit to fork)."""


def main(app: dict) -> None:
    """Run the command sys.argv names, in a fork of the warm server or here. `app` names what the
    server is for (stages/entry.py: WARM_APP): the project's `packages`, the function that runs a
    command in a fork (`run_in_fork`, "module:function") and here (`run_here`), what the server
    imports first (`preload`), and what each command does `without_server` ("start" one and wait,
    run here and start one "beside", or, for a command not named, just run here)."""
    args = sys.argv[1:]
    if not wanted(args):
        return cold(app)
    try:
        code = connect(command_of(args), app).run(sys.argv)
    except Refused as why:  # a server that cannot serve is worth a word: every stage runs slower
        print(f"mnist-pipeline: running in this process: {why} ({WARM_ENV}=0 skips the server)", file=sys.stderr)
        code = None
    except Unavailable as why:  # nothing ran: the command runs here
        if debugging():
            print(f"mnist-pipeline: running in this process: {why}", file=sys.stderr)
        code = None
    if code is None:  # outside the handlers: the command's own errors are not chained to why it runs here
        return cold(app)
    exit_like(code)


def debugging() -> bool:
    return os.environ.get("MNIST_PIPELINE_DEBUG", "") not in ("", "0")


def cold(app: dict) -> None:
    run_and_exit(named(app["run_here"]))


def named(target: str) -> Callable:
    """The function "module:function" names."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def run_and_exit(command: Callable[[], object]) -> NoReturn:
    """Run `command`, then end this process as the interpreter would, but without tearing it down:
    with torch, MLflow and matplotlib loaded, freeing every module's objects one by one took
    seconds after the last output, on every stage. What an ending must do is done: other threads are
    joined, the exit handlers run (MLflow ends its runs, logging flushes and closes its files),
    Python's and C's buffered output is flushed, and an uncaught exception is shown as Python shows
    it. Every file the pipeline writes is closed by then (pipeline.atomic)."""
    code, sig = 0, None
    try:
        command()
    except SystemExit as done:
        code = exit_code(done.code)
    except KeyboardInterrupt:  # Python shows it, and ends by the signal
        traceback.print_exc()
        code, sig = 130, signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what the interpreter's own ending does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    flush_c_streams()
    if sig is not None:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(code & 0xFF)


def flush_c_streams() -> None:
    """What C's exit() would flush: libraries' own printf output (cuDNN's and NCCL's logs) to a pipe."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def exit_code(code: object) -> int:
    """The exit status SystemExit(code) gives, as the interpreter reads it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def wanted(args: list[str]) -> bool:
    """Whether this command goes to a warm server: a stage's command, under DVC (or asked for),
    on Linux, never as a worker an outer launcher started."""
    setting = os.environ.get(WARM_ENV, "")
    if setting == "0" or sys.platform != "linux" or any(key in os.environ for key in LAUNCHER_ENV):
        return False
    if command_of(args) is None or {"-h", "--help"} & set(args) or "_MNIST_PIPELINE_COMPLETE" in os.environ:
        return False  # help, the version, shell completion: nothing to import
    return setting == "1" or "DVC_STAGE" in os.environ


def command_of(args: list[str]) -> str | None:
    """The sub-command, after the CLI's own -v; None for --version or nothing."""
    while args and args[0] in ("-v", "--verbose"):
        args = args[1:]
    return args[0] if args and not args[0].startswith("-") else None


def connect(command: str, app: dict) -> Client:
    try:
        key = server_key(app["packages"])
        address = server_address(key)
    except Unavailable:
        raise
    except Exception as exc:  # an editor's lock file, a package half-reinstalled: run here, not fail
        raise Unavailable(f"the warm server's key could not be computed ({type(exc).__name__}: {exc})") from None
    try:
        return Client(address, key)
    except Unavailable:
        plan = app["without_server"].get(command)
        if plan is None:
            raise
    start_server(address, key, app)
    if plan == "beside":
        raise Unavailable("the server starts beside this command, for the stages after it")
    return Client(address, key)


def server_address(key: str) -> str:
    """The server's socket: a file in a folder only this user can enter (so no other user can
    connect to it, take its name or fill its queue), named by the key through a secret kept there:
    /proc/net/unix shows every socket's path to every user, and the key digests the environment."""
    folder = private_folder()
    digest = hashlib.sha256(secret(folder) + key.encode()).hexdigest()[:32]
    return os.path.join(folder, f"warm-{digest}.sock")


def private_folder() -> str:
    """$XDG_RUNTIME_DIR/mnist-pipeline (systemd's per-user folder), else /tmp/mnist-pipeline-UID:
    made here when missing; Unavailable unless it is a folder of this user that no one else may
    enter or write (another user may have made it first, to catch or stall our commands)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    folder = os.path.join(runtime, "mnist-pipeline")
    if not os.path.isabs(runtime) or len(os.fsencode(folder)) > MAX_FOLDER_BYTES:
        folder = f"/tmp/mnist-pipeline-{os.getuid()}"
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise Unavailable(f"no private folder for the warm server's socket: {folder}: {exc.strerror}") from None
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise Unavailable(f"{folder} is not this user's private folder (owner uid {info.st_uid}, mode "
                          f"{stat.filemode(info.st_mode)}): remove it, and the next command makes it again")
    return folder


# A socket's path has at most 107 bytes (sun_path); the name in the folder takes 43 of them.
MAX_FOLDER_BYTES = 107 - len("/warm-.sock") - 32


def secret(folder: str) -> bytes:
    """32 random bytes kept in `folder` (made by whichever command needs them first)."""
    path = os.path.join(folder, "secret")
    try:
        with open(path, "rb") as kept:
            return kept.read()
    except FileNotFoundError:
        pass
    draft = f"{path}.{os.getpid()}"
    with open(os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as made:
        made.write(os.urandom(32))
    try:
        os.link(draft, path)  # all of it or nothing, and the first one made stays
    except FileExistsError:
        pass
    finally:
        os.unlink(draft)
    with open(path, "rb") as kept:
        return kept.read()


def unbuffered() -> bool:
    """Whether this Python runs with -u (or PYTHONUNBUFFERED), which sys.flags does not say: its
    standard streams then write through to unbuffered files."""
    stream = sys.__stdout__ or sys.__stderr__
    return type(getattr(stream, "buffer", None)).__name__ == "FileIO"


def per_command(name: str) -> bool:
    return name in PER_COMMAND_ENV or name.startswith(PER_COMMAND_PREFIX)


def server_key(packages: Iterable[str]) -> str:
    """A digest of everything a fresh `mnist-pipeline` process would read before its command
    starts, and so everything a fork of the server must share with this process."""
    facts = {
        "protocol": PROTOCOL,
        "python": [sys.executable, sys.version, repr(sys.flags), unbuffered(), sys.warnoptions, sys._xoptions,
                   [os.path.abspath(p) for p in sys.path]],
        "cwd": os.getcwd(),  # read on import (a matplotlibrc here, multiprocessing's ORIGINAL_DIR)
        "code": code_digest(packages),
        "packages": installed(),
        "outside": outside_code(packages),
        "config": [config_stamp(path) for path in matplotlib_configs()],  # read when matplotlib loads
        "env": sorted((k, v) for k, v in os.environ.items() if not per_command(k)),
        "user": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
        "host": [os.uname().nodename, namespaces(), read("/proc/self/cgroup")],
        "cpus": sorted(os.sched_getaffinity(0)),
        "priority": os.getpriority(os.PRIO_PROCESS, 0),
        "limits": [resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:40]


def code_digest(packages: Iterable[str]) -> str:
    """The project's own code (`packages`) as it is on disk: an edit starts a new server."""
    digest = hashlib.sha256()
    for folder in package_folders(packages):
        for path in sorted(Path(folder).rglob("*.py")):
            if path.is_file():  # not an editor's lock file (.#model.py, a link to nowhere)
                digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def package_folders(packages: Iterable[str]) -> list[str]:
    """The folders of the project's `packages`, as an import finds them."""
    found = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        found.extend((spec.submodule_search_locations or []) if spec else [])
    return found


def project_folders(packages: Iterable[str]) -> list[str]:
    return [os.path.dirname(os.path.abspath(folder)) for folder in package_folders(packages)]


def installed() -> list[str]:
    """The installed distributions, with their versions, and the .pth files with what they say
    (pip install, uninstall, an editable install)."""
    found = []
    for folder in sys.path:
        if folder.endswith(("site-packages", "dist-packages")) and os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith((".dist-info", ".egg-info")):  # a reinstall of one version rewrites its RECORD
                    found.append(name + "\0" + repr(config_stamp(os.path.join(folder, name, "RECORD"))[1:]))
                elif name.endswith(".pth"):
                    found.append(name + "\0" + read(os.path.join(folder, name)))
    return found


def outside_code(packages: Iterable[str]) -> list:
    """Every module file a fresh process could import from outside the standard library, the
    installed distributions and the project's own packages (code_digest): what `PYTHONPATH` or a
    .pth file adds. Stamped by size and modification time, as Python's own caches check them."""
    stamps = []
    skip = {os.path.abspath(p) for p in (os.getcwd(), *stdlib_folders(), *project_folders(packages))}
    for entry in sys.path:
        folder = os.path.abspath(entry or ".")
        if folder in skip or folder.endswith(("site-packages", "dist-packages")) or not os.path.isdir(folder):
            continue
        skip.add(folder)
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d.isidentifier())  # a package's name is one
            stamps.extend([os.path.join(root, name), *config_stamp(os.path.join(root, name))[1:]]
                          for name in sorted(files) if name.endswith((".py", ".so", ".pth")))
            if len(stamps) > MAX_OUTSIDE_FILES:
                raise Unavailable(f"{folder} (on sys.path) holds over {MAX_OUTSIDE_FILES} module files to key")
    return stamps


MAX_OUTSIDE_FILES = 20000


def stdlib_folders() -> list[str]:
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    return [os.path.join(prefix, "lib", version, sub) for prefix in {sys.base_prefix, sys.base_exec_prefix}
            for sub in ("", "lib-dynload")]


def matplotlib_configs() -> list[str]:
    """Where matplotlib looks for a matplotlibrc when it is imported."""
    config_dir = os.environ.get("MPLCONFIGDIR") or os.path.join(
        os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "matplotlib")
    return [os.path.join(os.getcwd(), "matplotlibrc"), os.environ.get("MATPLOTLIBRC", ""),
            os.path.join(config_dir, "matplotlibrc")]


def config_stamp(path: str) -> list:
    try:
        stat = os.stat(path)
    except OSError:
        return [path, None]
    return [path, stat.st_mtime_ns, stat.st_size]


def namespaces() -> list[str]:
    found = []
    for kind in ("mnt", "net", "uts", "ipc", "pid", "user", "cgroup"):
        try:
            found.append(os.readlink(f"/proc/self/ns/{kind}"))
        except OSError:
            found.append(kind)
    return found


def read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


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


def exit_like(code: int) -> None:
    """Exit as the fork did: its code, or killed by its signal (what a shell and DVC report)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        code = 128 - code
    sys.exit(code)
