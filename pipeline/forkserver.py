"""DDP workers that start with their imports done: forks of a server that imported them while the
launcher did its own checks.

A local launch (`train --mode ddp`, `commcheck`) used to start each worker as a fresh `python`,
which imported torch, MLflow and torch._dynamo after the launcher had imported torch (and MLflow)
for its own checks: two import chains in a row on the stage's critical path, more than two bare
torch imports (benchmarks/pipeline_overhead.py). Now the command starts multiprocessing's fork
server first thing, before it imports torch itself. The server imports what a worker needs
(pipeline.preloaded) on another core while the launcher imports and checks, and torchrun's own
agent (elastic_launch, with its rendezvous, environment and failure handling as before) starts each
worker as a fork of it: start_method "forkserver".

Safe on GPUs: the server is a fresh interpreter that only imports. It never touches CUDA and runs
no Python thread, so each fork initialises CUDA for itself as a fresh process would. Under an
outer torchrun, Slurm or Kubeflow nothing here runs: the worker is the process they started.

Under DVC the command is itself a fork of the warm server (stages/warm.py), with everything
imported already: there `fork_here` forks the fork server from the command's process before its
command runs, instead of starting a fresh interpreter, and pipeline.preloaded is not needed.

Imports nothing heavy: the CLI calls `start` before it loads the stage's module.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import socket
import traceback
from multiprocessing import connection, resource_tracker, util

# What the server imports for each command's workers, once (pipeline/preloaded.py says why).
PRELOAD = {"commcheck": ["pipeline.preloaded", "stages.commcheck"],
           # torch.optim and torch.use_deterministic_algorithms import torch._dynamo on first use.
           "train": ["pipeline.preloaded", "torch._dynamo", "stages.train"]}
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


def start(command: str) -> None:
    """Start the fork server for `command`'s workers now, if it is not running: it imports in the
    background while this process goes on. It holds this process's environment as it is now,
    which every worker inherits (torchrun's variables are set in each worker on top); it ends with
    this process."""
    multiprocessing.set_forkserver_preload(PRELOAD[command])
    multiprocessing.forkserver.ensure_running()


def fork_here() -> None:
    """Start the fork server as a fork of this process, which must have imported what the workers
    need and run nothing yet: a fork of the warm server (stages/warm_server.py), before its
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
                os.setsid()  # as pipeline.preloaded does in a server started anew
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


def detach_worker() -> None:
    """First thing in a worker the server forked, to be what torchrun's agent makes of a worker
    it execs. A session of its own: a Ctrl-C at the terminal, or a signal to the launcher's
    process group, reaches the agent, which passes it on once, not every worker twice. And
    without the launcher's end of the pipe whose closing tells the server the launcher is gone
    (CPython hands it to every child): with the launcher killed outright the server then exits,
    and each worker gets the SIGINT torch asks for when its parent dies (PR_SET_PDEATHSIG), so no
    worker waits forever for a launcher that will never read its result."""
    os.setsid()
    server = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None
