"""A pre-imported starter for the tests' `mnist-pipeline` commands (#52).

The suite is CPU-bound, and most of its CPU went to fresh processes' imports: a `mnist-pipeline`
command a test runs imports torch, torch._dynamo (at its first optimizer step) and MLflow before
its first line of work, 4 to 5 CPU s on a fast day, more than most commands then do. Here one
process per test worker imports those libraries once, and each command is a fork of it that
becomes the process `subprocess.run(cmd, capture_output=True, text=True)` would have started: its
arguments, working directory, environment, umask, signals ignored and blocked, standard streams
(pipes), open files, process group, sys.path as Python builds it, freshly seeded generators, and
what the imports wrote to stderr. Then it runs the console script itself, so the project's own
code (pipeline/, stages/: the copy's where the command runs in a copy) is imported afresh in the
fork, from where a fresh process would import it, and each run records the files it ran. The
command ends as the console script ends it (pipeline/runtime/warm_exit.py), and its exit status
comes back as subprocess.run's would.

What a fork cannot be, it is not asked to be. Only the venv's own `mnist-pipeline` runs as one,
with an environment that differs from its starter's only in variables nothing the starter
imported reads on import (`late_read`: the pipeline's, DVC's, git's, S3's, MLflow's but the three
it reads on import, PYTHONPATH where it shadows nothing imported). Anything else (a compiler, a
CUDA stand-in, TMPDIR, HOME, a launcher's RANK) runs in a fresh process, as does a warm server's
client (its server outlives it by who its parent is), every command under MNP_TEST_ZYGOTE=0, and
every one a test starts itself with Popen (signals, timing, the README in a fresh shell, `dvc
repro`'s stages). What a fork shares with its starter regardless: the string-hash seed, and the
order of the exit handlers MLflow registers on import (before the command's own, as in the warm
server's forks). tests/test_zygote.py checks a fork against a fresh process of the same script.

Each command's parent is a runner, forked per command, which leads the command's process group,
waits for it and reports its end and CPU time; a runner whose client (the test) went away kills
the group. The starter ends when its test worker does (its stdin closes).
"""

from __future__ import annotations

import functools
import io
import json
import locale
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ZYGOTE_ENV = "MNP_TEST_ZYGOTE"  # 0: every command in a fresh process
# What the warm server imports (stages/entry.py's WARM_APP), but none of the project's own modules:
# MLflow after the settings pipeline/tracking/__init__.py makes before MLflow reads them.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.elastic.multiprocessing", "numpy", "yaml", "click",
           "mlflow", "mlflow.store.tracking.sqlalchemy_store")
MLFLOW_SETTINGS = Path(__file__).resolve().parents[1] / "pipeline" / "tracking" / "__init__.py"
# Variables read only once a command's own code runs, never by what PRELOAD imports: a command's may
# differ from the starter's in these and it still runs as a fork. MLflow reads a few on import, and
# whether it runs under pytest (PYTEST_CURRENT_TEST).
LATE_READ_PREFIXES = ("MNIST_", "MNP_", "MLFLOW_", "DVC_", "AWS_", "GIT_", "PYTEST_")
LATE_READ = {"PYTHONPATH", "PWD", "OLDPWD"}
READ_ON_IMPORT = {"MLFLOW_LOGGING_LEVEL", "MLFLOW_CONFIGURE_LOGGING", "MLFLOW_DISABLE_TELEMETRY"}
UNDER_PYTEST = "PYTEST_CURRENT_TEST"
POLL_S = 0.05  # how often the test's side looks for a starting starter
CPU_USED = [0.0]  # CPU seconds of the commands that ran as forks, and of the processes they waited for


def late_read(name: str) -> bool:
    return name not in READ_ON_IMPORT and (name in LATE_READ or name.startswith(LATE_READ_PREFIXES))


@functools.cache
def mlflow_defaults() -> dict[str, str]:
    """The variables pipeline/tracking/__init__.py sets where unset (`os.environ.setdefault`)."""
    import ast

    calls = [node for node in ast.walk(ast.parse(MLFLOW_SETTINGS.read_text())) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault"
             and all(isinstance(arg, ast.Constant) for arg in node.args)]
    return {call.args[0].value: call.args[1].value for call in calls}


def imports_see(env: dict[str, str]) -> frozenset:
    """What the preloaded imports read of a command's environment: every variable but the late-read
    ones, those MLflow reads on import as pipeline.tracking leaves them, and whether pytest runs.
    Two environments alike in this are one to a starter."""
    defaults = mlflow_defaults()
    seen = {name: value for name, value in env.items() if not late_read(name) and name not in READ_ON_IMPORT}
    seen.update({name: env.get(name, defaults.get(name)) for name in READ_ON_IMPORT})
    seen[UNDER_PYTEST] = str(UNDER_PYTEST in env)
    return frozenset(seen.items())


# --- the test's side --------------------------------------------------------------------------


class Starter:
    """A test worker's starter process, started at its first command."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.key = imports_see(env)
        self.env = {name: value for name, value in env.items() if not late_read(name) or name == UNDER_PYTEST}
        self.folder = tempfile.mkdtemp(prefix="mnp-zygote-")
        self.address = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen(
            [python, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
                           "from tests.zygote import serve; serve(sys.argv[1])", self.address],
            stdin=subprocess.PIPE, env=self.env, cwd="/", start_new_session=True)
        deadline = time.monotonic() + 120
        ready = Path(self.address + ".ready")
        while not ready.is_file():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise OSError("the tests' starter did not start")
            time.sleep(POLL_S)
        self.modules = set(json.loads(ready.read_text()))  # the top-level names it imported

    def serves(self, env: dict[str, str], cwd: Path) -> bool:
        if self.process.poll() is not None or imports_see(env) != self.key or not Path(cwd).is_dir():
            return False  # a missing folder: subprocess.run's own error
        if env.get("MNIST_PIPELINE_WARM", "") not in ("", "0") or "DVC_STAGE" in env:
            return False  # a warm server's client: its server's life follows its parent's
        # PYTHONPATH: an entry that holds a module the starter imported (or one Python imports at
        # start) would have been imported from there.
        for entry in env.get("PYTHONPATH", "").split(os.pathsep):
            if importable(Path(cwd, entry or ".")) & (self.modules | {"sitecustomize", "usercustomize"}):
                return False
        return True

    def run(self, script: str, args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
        """`script args` as a fork, as subprocess.run(capture_output=True, text=True) runs it: its
        output through pipes, read until every process holding them has closed them."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            conn = self.start([script, *args], cwd, env, out_w, err_w)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        said: dict[object, bytearray] = {out_r: bytearray(), err_r: bytearray(), conn: bytearray()}
        try:
            with selectors.DefaultSelector() as selector:
                for source in said:
                    selector.register(source, selectors.EVENT_READ)
                while selector.get_map():
                    for key, _ in selector.select():
                        source = key.fileobj
                        chunk = source.recv(4096) if source is conn else os.read(source, 65536)
                        said[source] += chunk
                        if not chunk:
                            selector.unregister(source)
        finally:  # closing the socket first kills the command, if it still runs (a test's timeout)
            conn.close()
            os.close(out_r)
            os.close(err_r)
        if not said[conn].endswith(b"\n"):
            raise OSError("the tests' starter went away during a command")
        reply = json.loads(bytes(said[conn]))
        CPU_USED[0] += reply["cpu"]
        return subprocess.CompletedProcess([Path(script).name, *args], reply["exit"], text_of(said[out_r]),
                                           text_of(said[err_r]))

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], out: int, err: int) -> socket.socket:
        """The command started, writing to the file descriptors `out` and `err`; its end is said on
        the socket returned, and closing it first kills the command."""
        ignored = [int(sig) for sig in signal.valid_signals() if sig not in (signal.SIGKILL, signal.SIGSTOP)
                   and signal.getsignal(sig) == signal.SIG_IGN]
        request = {"argv": argv, "cwd": os.path.abspath(cwd), "env": env, "umask": umask(), "ignored": ignored,
                   "blocked": [int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, [])]}
        conn = socket.socket(socket.AF_UNIX)
        try:
            conn.connect(self.address)
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, out, err])
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # it ends when its stdin does
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def importable(folder: Path) -> set[str]:
    """The top-level modules a folder on sys.path offers: its modules and its regular packages (a
    folder without __init__.py is a namespace portion, which any module or package found after it wins over)."""
    import importlib.machinery

    if not folder.is_dir():
        return set()
    suffixes = tuple(importlib.machinery.all_suffixes())
    return {path.name.partition(".")[0] for path in folder.iterdir()
            if (path.is_file() and path.name.endswith(suffixes)) or (path / "__init__.py").is_file()}


def umask() -> int:
    """This process's umask, read without setting it (which another thread would see)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise OSError("no Umask in /proc/self/status")


def text_of(data: bytes) -> str:
    """What subprocess.run(text=True) gives for these bytes: the locale's encoding, newlines as \\n."""
    return io.TextIOWrapper(io.BytesIO(data), encoding=locale.getpreferredencoding(False)).read()


# --- the starter ------------------------------------------------------------------------------


def serve(address: str) -> None:
    """Imports PRELOAD, then forks a runner for each command, until the test worker is gone."""
    import runpy

    with tempfile.TemporaryFile() as said, redirected(2, said.fileno()):  # what a fresh command's imports say
        runpy.run_path(str(MLFLOW_SETTINGS))  # MLflow's settings, as a command's first import of pipeline.tracking
        for module in PRELOAD:
            __import__(module)
        sys.stderr.flush()
        said.seek(0)
        imports_said = said.read()
    import threading

    import torch

    if threading.active_count() != 1 or torch.cuda.is_initialized():  # the forks would lack the thread, share CUDA
        raise SystemExit(f"tests' starter: importing {PRELOAD} started a thread or CUDA")
    base_path = sys.path[2:]  # without '' (python -c) and this project's folder
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(16)
    ready = Path(address + ".ready")
    Path(address + ".part").write_text(json.dumps(sorted({name.partition(".")[0] for name in sys.modules})))
    Path(address + ".part").rename(ready)  # whole when the test's side reads it
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(sys.stdin, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select(1.0):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    if os.fork() == 0:
                        listener.close()
                        runner(conn, base_path, imports_said)  # never returns
                    conn.close()
                elif not sys.stdin.buffer.read1(1):  # the test worker is gone: end without torch's teardown
                    listener.close()
                    os._exit(0)
            reap()


class redirected:
    """Writes to file descriptor `fd` go to `target` meanwhile."""

    def __init__(self, fd: int, target: int) -> None:
        self.fd, self.target = fd, target

    def __enter__(self) -> None:
        self.saved = os.dup(self.fd)
        os.dup2(self.target, self.fd)

    def __exit__(self, *_) -> None:
        os.dup2(self.saved, self.fd)
        os.close(self.saved)


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def runner(conn: socket.socket, base_path: list[str], imports_said: bytes) -> None:
    """A command's parent, leading its process group: forks it, waits for it, says how it ended and
    its CPU time; kills the group (itself too) if the test goes away first."""
    code = 1
    try:
        os.setpgid(0, 0)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while message and not message.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:  # the test went away before it had said what to run
                break
            message += more
        if not message.endswith(b"\n"):
            return
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            conn.close()
            become(request, fds, base_path, imports_said)  # never returns
        for fd in fds:
            os.close(fd)
        with selectors.DefaultSelector() as selector:
            ended = os.pidfd_open(pid)
            selector.register(ended, selectors.EVENT_READ)
            selector.register(conn, selectors.EVENT_READ)  # the client only reads: anything readable is its end
            if any(key.fileobj is conn for key, _ in selector.select()):
                os.killpg(0, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
        reply = {"exit": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
        conn.sendall(json.dumps(reply).encode() + b"\n")
        code = 0
    finally:
        os._exit(code)


def become(request: dict, fds: list[int], base_path: list[str], imports_said: bytes) -> None:
    """In the fork: the process `argv` would have started as, then the console script itself."""
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # subprocess's close_fds: the starter's sockets too
        # Signals as a fresh Python starts with the test's: what it ignores stays ignored (SIGPIPE
        # and SIGXFSZ always are), SIGINT raises KeyboardInterrupt, its blocked ones stay blocked.
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGCHLD, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in request["ignored"]:
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
        sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as Python sets it up for what fd 1 is
        os.write(2, imports_said)
        cwd = request["cwd"]
        os.chdir(cwd)
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["argv"][0]
        sys.path[:] = script_path(script, os.environ.get("PYTHONPATH", ""), cwd, base_path)
        sys.argv = list(request["argv"])
        # What the imports took from the starter's folder (/), a fresh process takes from its own.
        sys.modules["multiprocessing.process"].ORIGINAL_DIR = cwd
        sys.modules["torch._dynamo.config"].debug_dir_root = os.path.join(cwd, "torch_compile_debug")
        # The generators a fresh process seeds from the OS: numpy's global one and Python's.
        sys.modules["numpy"].random.seed()
        if "random" in sys.modules:
            sys.modules["random"].seed()
        name(Path(script).name)
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        if not isinstance(done.code, (int, type(None))):
            print(done.code, file=sys.stderr)
    except BaseException as error:  # shown from the script's own frame on, as Python shows it
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != request["argv"][0]:
            tb = tb.tb_next
        error.__traceback__ = tb or error.__traceback__
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)


def script_path(script: str, pythonpath: str, cwd: str, base_path: list[str]) -> list[str]:
    """sys.path as Python builds it for `script`: the script's real folder, then PYTHONPATH's
    entries made absolute (an empty one: the working directory), then the rest, each once."""
    rest: list[str] = []
    for entry in [os.path.join(cwd, entry) if entry else cwd for entry in pythonpath.split(os.pathsep)] \
            if pythonpath else []:
        entry = os.path.normpath(entry)
        if entry not in rest:
            rest.append(entry)
    return [os.path.dirname(os.path.realpath(script)), *rest, *(path for path in base_path if path not in rest)]


def name(short: str) -> None:
    """The short name a fresh process of the script has (`ps -o comm`, process accounting)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(short.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def log(cmd: list[str], how: str) -> None:
    """MNP_TEST_ZYGOTE_LOG=FILE: a line per command the tests run, saying how it ran, and why afresh."""
    path = os.environ.get("MNP_TEST_ZYGOTE_LOG")
    if path:
        with open(path, "a") as handle:
            handle.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{' '.join(cmd[:2])}\t{how}\n")


MAX_STARTERS = 3
_STARTERS: dict[frozenset, Starter] = {}  # by what their imports saw of the environment, oldest first
_SEEN: dict[frozenset, int] = {}
_FAILED: set[frozenset] = set()  # environments a starter could not start under: afresh, not retried


def starter_for(python: str, env: dict[str, str], cwd: Path) -> tuple[Starter | None, str]:
    """A starter whose imports saw what a fresh process of a command with `env` would, and a word on
    how the command runs. The worker's first is started at its first command; one for another
    environment (a test's own CXX, a variable torch set in this process) at the second command
    with it, so a test's one-off setting costs no start; at most MAX_STARTERS run."""
    if os.environ.get(ZYGOTE_ENV) == "0" or sys.platform != "linux":
        return None, f"afresh: {ZYGOTE_ENV}=0"
    key = imports_see(env)
    if key in _FAILED:
        return None, "afresh: no starter starts with its environment"
    found = _STARTERS.get(key)
    if found is not None and found.process.poll() is None:
        return (found, "fork") if found.serves(env, cwd) else (None, "afresh: a warm client, or PYTHONPATH")
    _SEEN[key] = _SEEN.get(key, 0) + 1
    if _SEEN[key] < 2 and _SEEN.keys() != {key}:
        return None, "afresh: the first command with its environment"
    try:
        started = Starter(python, env)
    except OSError as exc:
        _FAILED.add(key)
        return None, f"afresh: {exc}"
    old = _STARTERS.pop(key, None)
    if old is not None:
        old.close()
    _STARTERS[key] = started
    while len(_STARTERS) > MAX_STARTERS:
        _STARTERS.pop(next(iter(_STARTERS))).close()
    return (started, "fork") if started.serves(env, cwd) else (None, "afresh: a warm client, or PYTHONPATH")


def forget(env: dict[str, str]) -> None:
    """Ends the starter for `env`'s environment, if one runs."""
    started = _STARTERS.pop(imports_see(env), None)
    if started is not None:
        started.close()


def close_all() -> None:
    for started in _STARTERS.values():
        started.close()
    _STARTERS.clear()


import atexit  # noqa: E402

atexit.register(close_all)
