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

Its parts, each importing only the standard library and those before it, as this module does:
this is what every stage's client pays. warm_common (the settings, the errors that make a command
run here, a "module:function" name found), warm_key (the server's key), warm_address (its socket's
folder and name), warm_start (starting a server), warm_client (one command run by the server),
warm_exit (how a command's process ends, here, in a fork or as the fork's client).
"""

from __future__ import annotations

import os
import sys

from pipeline.runtime.warm_address import server_address
from pipeline.runtime.warm_client import Client
from pipeline.runtime.warm_common import WARM_ENV, Refused, Unavailable, debugging, named
from pipeline.runtime.warm_exit import exit_like, run_and_exit
from pipeline.runtime.warm_key import server_key
from pipeline.runtime.warm_start import start_server

# Names kept here from before the client was split into its parts: tests/test_warm.py reads them as
# `warm.NAME` (and patches `warm.server_key`, which connect() looks up in this module).
from pipeline.runtime.warm_address import CONNECT_TIMEOUT_S, private_folder  # noqa: F401
from pipeline.runtime.warm_common import IDLE_ENV  # noqa: F401
from pipeline.runtime.warm_key import unbuffered  # noqa: F401
from pipeline.runtime.warm_start import SERVER_CODE  # noqa: F401

LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")


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


def cold(app: dict) -> None:
    run_and_exit(named(app["run_here"]))


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
