"""A pre-imported starter for the tests' `mnist-pipeline` commands (#52).

The suite is CPU-bound, and most of its CPU went to fresh processes' imports: a `mnist-pipeline`
command a test runs imports torch (and torch._dynamo, at its first optimizer step) before its
first line of work, 2 to 3.5 CPU s on a fast day, more than most commands then do. Here one
process per test worker imports those libraries once, and each command is a fork of it that
becomes the process a fresh `mnist-pipeline` would have been: its arguments, working directory,
environment, umask, standard streams, process group and sys.path; then it runs the console script
itself, so the project's own code (pipeline/, stages/, the copy's where the command runs in a
copy) is imported afresh in the fork, from where a fresh process would import it, and each run
records the files it ran. The command ends as the console script ends it (pipeline/runtime/
warm_exit.py), its exit status comes back as subprocess.run's would.

What a fork cannot be, it is not asked to be: only the venv's own `mnist-pipeline`, with an
environment that differs from the starter's only in variables nothing it imported reads at import
(LATE_READ: the pipeline's, MLflow's (which it never imports), DVC's, git's, S3's, PYTHONPATH). A
command with anything else changed (a compiler, a CUDA stand-in, TMPDIR, HOME, a launcher's RANK)
runs in a fresh process, as does every command when MNP_TEST_ZYGOTE=0, and every one a test
starts itself with Popen (signals, timing, the README in a fresh shell). The product's own forks
of a pre-imported process (the warm server under DVC, the DDP fork server) are tested as such
in tests/test_warm.py and tests/test_forkserver.py; tests/test_zygote.py checks that a fork here
sees what a fresh process sees.

Each fork's parent is a runner, forked per command, which waits for it and reports; a runner
whose client (the test) went away kills the command's process group. The starter ends when its
test worker does (its stdin closes).
"""

from __future__ import annotations

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
# differ from the starter's in these and it still runs as a fork. MLflow reads a few on import.
LATE_READ_PREFIXES = ("MNIST_", "MNP_", "MLFLOW_", "DVC_", "AWS_", "GIT_", "PYTEST_")
LATE_READ = {"PYTHONPATH", "PWD", "OLDPWD"}
READ_ON_IMPORT = {"MLFLOW_LOGGING_LEVEL", "MLFLOW_CONFIGURE_LOGGING", "MLFLOW_DISABLE_TELEMETRY"}
POLL_S = 0.05


def late_read(name: str) -> bool:
    return name not in READ_ON_IMPORT and (name in LATE_READ or name.startswith(LATE_READ_PREFIXES))


def mlflow_defaults() -> dict[str, str]:
    """The variables pipeline/tracking/__init__.py sets where unset (`os.environ.setdefault`)."""
    import ast

    calls = [node for node in ast.walk(ast.parse(MLFLOW_SETTINGS.read_text())) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault"
             and all(isinstance(arg, ast.Constant) for arg in node.args)]
    return {call.args[0].value: call.args[1].value for call in calls}


def imports_see(env: dict[str, str]) -> frozenset:
    """What the preloaded imports read of a command's environment: every variable but the late-read
    ones, and those MLflow reads on import as pipeline.tracking leaves them. Two environments
    alike in this are one to a starter."""
    defaults = mlflow_defaults()
    seen = {name: value for name, value in env.items() if not late_read(name) and name not in READ_ON_IMPORT}
    seen.update({name: env.get(name, defaults.get(name)) for name in READ_ON_IMPORT})
    return frozenset(seen.items())


# --- the test's side --------------------------------------------------------------------------


class Starter:
    """A test worker's starter process, started at its first command."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.key = imports_see(env)
        self.env = {name: value for name, value in env.items() if not late_read(name)}
        self.folder = tempfile.mkdtemp(prefix="mnp-zygote-")
        self.address = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen(
            [python, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
                           "from tests.zygote import serve; serve(sys.argv[1])", self.address],
            stdin=subprocess.PIPE, env=self.env, cwd="/", start_new_session=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.address + ".ready"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise OSError("the tests' starter did not start")
            time.sleep(POLL_S)

    def serves(self, env: dict[str, str]) -> bool:
        return self.process.poll() is None and imports_see(env) == self.key

    def run(self, script: str, args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
        """`script args` as a fork, as subprocess.run(capture_output=True, text=True) runs it: its
        output through pipes, read until every process holding them has closed them."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            conn = self.start([script, *args], cwd, env, out_w, err_w)
        finally:
            os.close(out_w)
            os.close(err_w)
        said: dict[object, bytearray] = {out_r: bytearray(), err_r: bytearray(), conn: bytearray()}
        with conn, selectors.DefaultSelector() as selector:
            for source in said:
                selector.register(source, selectors.EVENT_READ)
            while selector.get_map():
                for key, _ in selector.select():
                    source = key.fileobj
                    chunk = source.recv(4096) if source is conn else os.read(source, 65536)
                    said[source] += chunk
                    if not chunk:
                        selector.unregister(source)
                        if source is not conn:
                            os.close(source)
        if not said[conn].endswith(b"\n"):
            raise OSError("the tests' starter went away during a command")
        code = json.loads(bytes(said[conn]))["exit"]
        return subprocess.CompletedProcess([Path(script).name, *args], code, text_of(said[out_r]),
                                           text_of(said[err_r]))

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], out: int, err: int) -> socket.socket:
        """The command started, writing to the file descriptors `out` and `err`; its end is said on
        the socket returned, and closing it first kills the command."""
        conn = socket.socket(socket.AF_UNIX)
        try:
            conn.connect(self.address)
            umask = os.umask(0)
            os.umask(umask)
            request = json.dumps({"argv": argv, "cwd": str(cwd), "env": env, "umask": umask}).encode()
            socket.send_fds(conn, [request + b"\n"], [0, out, err])
        except OSError:
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
        shutil.rmtree(self.folder, ignore_errors=True)


def text_of(data: bytes) -> str:
    """What subprocess.run(text=True) gives for these bytes: the locale's encoding, newlines as \\n."""
    return io.TextIOWrapper(io.BytesIO(data), encoding=locale.getpreferredencoding(False)).read()


# --- the starter ------------------------------------------------------------------------------


def serve(address: str) -> None:
    import runpy

    runpy.run_path(str(MLFLOW_SETTINGS))  # MLflow's settings, as a command's first import of pipeline.tracking makes them
    for module in PRELOAD:
        __import__(module)
    import threading

    if threading.active_count() != 1:  # a thread would not be in the forks: unfit to fork
        raise SystemExit(f"tests' starter: importing {PRELOAD} started a thread")
    base_path = sys.path[2:]  # without '' (python -c) and this project's folder
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(16)
    Path(address + ".ready").touch()
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(sys.stdin, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select(1.0):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    if os.fork() == 0:
                        listener.close()
                        runner(conn, base_path)  # never returns
                    conn.close()
                elif not sys.stdin.buffer.read1(1):  # the test worker is gone
                    return
            reap()


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def runner(conn: socket.socket, base_path: list[str]) -> None:
    """A command's parent: forks it, waits for it, says how it ended; kills its group if the test
    goes away first."""
    code = 1
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not message.endswith(b"\n"):
            message += conn.recv(1 << 20)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            conn.close()
            become(request, fds, base_path)  # never returns
        for fd in fds:
            os.close(fd)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                code = 0
                break
            if _hung_up(conn):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                break
    finally:
        os._exit(code)


def _hung_up(conn: socket.socket) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(conn, selectors.EVENT_READ)
        return bool(selector.select(POLL_S))  # the client only reads: anything readable is its end


def become(request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the fork: the process `argv` would have started as, then the console script itself."""
    try:
        os.setpgid(0, 0)  # a group of its own, which its runner kills if the test goes away
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["argv"][0]
        # As Python builds it for a script: the script's folder, PYTHONPATH, then the rest.
        extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        sys.path[:] = [os.path.dirname(script), *extra, *base_path]
        sys.argv = list(request["argv"])
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


def starter_for(python: str, env: dict[str, str]) -> tuple[Starter | None, str]:
    """A starter whose imports saw what a fresh process of a command with `env` would, and a word on
    how the command runs. The worker's first is started at its first command; one for another
    environment (a test's own CXX, a variable torch set in this process) at the second command
    with it, so a test's one-off setting costs no start; at most MAX_STARTERS run."""
    if os.environ.get(ZYGOTE_ENV) == "0" or sys.platform != "linux":
        return None, "afresh: MNP_TEST_ZYGOTE=0"
    key = imports_see(env)
    if key in _STARTERS and _STARTERS[key].process.poll() is None:
        return _STARTERS[key], "fork"
    _SEEN[key] = _SEEN.get(key, 0) + 1
    if _SEEN[key] < 2 and _SEEN.keys() != {key}:
        return None, "afresh: the first command with its environment"
    try:
        started = Starter(python, env)
    except OSError as exc:
        return None, f"afresh: {exc}"
    old = _STARTERS.pop(key, None)
    if old is not None:
        old.close()
    _STARTERS[key] = started
    while len(_STARTERS) > MAX_STARTERS:
        _STARTERS.pop(next(iter(_STARTERS))).close()
    return started, "fork"


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
