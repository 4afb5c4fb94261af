"""DDP workers that start with their imports done: forks of a server that imported them while the
launcher did its own checks.

A local launch (`train --mode ddp`, `commcheck`) used to start each worker as a fresh `python`,
which imported torch, MLflow and torch._dynamo after the launcher had imported torch (and MLflow)
for its own checks: two import chains in a row on the stage's critical path, more than two bare
torch imports (benchmarks/pipeline_overhead.py). Now the command starts multiprocessing's fork
server first thing, before it imports torch itself. The server imports what a worker needs
(pipeline.runtime.preloaded) on another core while the launcher imports and checks, and torchrun's own
agent (elastic_launch, with its rendezvous, environment and failure handling as before) starts each
worker as a fork of it: start_method "forkserver".

Safe on GPUs: the server is a fresh interpreter that only imports. It never touches CUDA and runs
no Python thread, so each fork initialises CUDA for itself as a fresh process would. Under an
outer torchrun, Slurm or Kubeflow nothing here runs: the worker is the process they started.

Under DVC the command is itself a fork of the warm server (pipeline/runtime/warm.py), with everything
imported already: there `fork_here` forks the fork server from the command's process before its
command runs, instead of starting a fresh interpreter, and pipeline.runtime.preloaded is not needed.

Imports nothing heavy: the CLI calls `start` before it loads the stage's module.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from multiprocessing import connection, resource_tracker, util
from pathlib import Path
from typing import Iterator

START_METHOD = "forkserver"  # torchrun's agent starts each worker as a fork of the server


# sun_path holds 108 bytes with its NUL; CPython names the server's socket
# <temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX, 32 bytes past the temp dir (TMPDIR).
UNIX_PATH_MAX = 107
SOCKET_NAME_BYTES = len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def check_socket_path() -> None:
    """The fork server's socket fits in the temp dir, else a line that names TMPDIR and the
    limit (Python's own error is a traceback ending "AF_UNIX path too long")."""
    import tempfile

    from pipeline.errors import PipelineError

    folder = tempfile.gettempdir()
    needed = len(os.fsencode(folder)) + SOCKET_NAME_BYTES
    if needed > UNIX_PATH_MAX:
        raise PipelineError(
            f"TMPDIR={folder} is {len(os.fsencode(folder))} bytes long: the DDP workers' fork server puts a socket "
            f"there whose path would be {needed} bytes, over the {UNIX_PATH_MAX} a Unix socket allows; set TMPDIR "
            f"to a folder of at most {UNIX_PATH_MAX - SOCKET_NAME_BYTES} bytes (e.g. TMPDIR=/tmp)")


# Names the training a `train` command starts (the "snapshot" of its record, unfinished.json), in
# the environment the fork server copies for its workers: a worker finding a record without its
# token knows it is another training's. Set before the server starts (stages.cli).
SNAPSHOT_ENV = "MNIST_PIPELINE_INPUTS_SNAPSHOT"


def start(preload: list[str]) -> None:
    """Start the fork server for a command's workers now, if it is not running: it imports the
    modules `preload` names (stages.common.WORKER_PRELOAD) in the background while this process
    goes on. It holds this process's environment as it is now, which every worker inherits
    (torchrun's variables are set in each worker on top); it ends with this process."""
    multiprocessing.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()


def run_named(target: str, *args: str) -> None:
    """A worker's entry point, named `module:function` (torchrun's agent calls it in each worker):
    the library starts the workers of a command it does not import."""
    import importlib

    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(*args)


def fork_here() -> None:
    """Start the fork server as a fork of this process, which must have imported what the workers
    need and run nothing yet: a fork of the warm server (pipeline/runtime/warm_server.py), before its
    command starts. It is then what `start` would have started, without importing anything anew.
    multiprocessing's own server code runs in it, set up as `ensure_running` sets it up."""
    server = multiprocessing.forkserver._forkserver
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(alive_w)
                os.setsid()  # as pipeline.runtime.preloaded does in a server started anew
                multiprocessing.forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit:  # every launcher is gone: its normal end
                pass
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def detach_worker(registry: Path) -> None:
    """First thing in a worker the server forked, to be what torchrun's agent makes of a worker
    it execs. A session of its own: a Ctrl-C at the terminal, or a signal to the launcher's
    process group, reaches the agent, which passes it on once, not every worker twice. And
    without the launcher's end of the pipe whose closing tells the server the launcher is gone
    (CPython hands it to every child): with the launcher killed outright the server then exits.

    Its parent is the server, so the server's death is this worker's SIGTERM (PR_SET_PDEATHSIG),
    which unwinds the stage and ends its runs: torch asks for SIGINT, which does nothing where
    SIGINT is ignored (`dvc repro &` in a script starts every command so). And it writes its pid
    into the launcher's `registry`: a server killed under its workers (the OOM killer) hides them
    from the agent, which learns each worker's end from the server, so the launcher kills the
    ones it finds there (`workers_stopped_on_failure`)."""
    server_file = registry / SERVER_FILE
    parent = int(server_file.read_text()) if server_file.is_file() else os.getppid()
    os.setsid()
    server = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the server died before the line above: nobody would stop this worker
        os._exit(1)
    # From here a stop signal unwinds the command, as the stage's own handler (lifecycle) will.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    pid = os.getpid()
    (registry / str(pid)).write_text(_start_time(pid) or "")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SERVER_FILE = "server"  # in the registry: the fork server's pid, each worker's parent


@contextmanager
def workers_stopped_on_failure() -> Iterator[Path]:
    """A folder each worker registers in (`detach_worker`). When the launch fails, every
    registered worker still running is killed and waited for before the failure goes on, so that
    none writes outputs or ends runs for a training its launcher has already failed, nor outlives
    the lock that keeps the next training out."""
    with tempfile.TemporaryDirectory(prefix="mnist-workers-") as folder:
        registry = Path(folder)
        server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
        if server is not None:  # what a worker checks its parent against, however early the server died
            (registry / SERVER_FILE).write_text(str(server))
        try:
            yield registry
        except BaseException:
            _kill_registered(registry)
            raise


def _kill_registered(registry: Path, patience_s: float = 30.0) -> None:
    running = {}
    for entry in registry.iterdir():
        if entry.name == SERVER_FILE:
            continue
        pid, started = int(entry.name), entry.read_text()
        if _start_time(pid) == started:  # the same process, not a later one that took its pid
            running[pid] = started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
    deadline = time.monotonic() + patience_s  # SIGKILL cannot be refused; a disk in trouble can delay it
    while running and time.monotonic() < deadline:
        running = {pid: started for pid, started in running.items() if _start_time(pid) == started}
        time.sleep(0.05)


def _start_time(pid: int) -> str | None:
    """When `pid` started, in clock ticks since boot; None once it has ended (gone, or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]


def server_end() -> tuple[int, str] | None:
    """This process's fork server and how it ended ("was killed by SIGKILL", "exited with code 1"),
    or None while it runs. It is this process's child: looked at, not reaped."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return None
    try:
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return pid, "ended"
    if ended is None:
        return None
    if ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        try:
            return pid, f"was killed by {signal.Signals(ended.si_status).name}"
        except ValueError:  # a real-time signal has no name
            return pid, f"was killed by signal {ended.si_status}"
    return pid, f"exited with code {ended.si_status}"
