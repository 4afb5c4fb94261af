"""`mnist-pipeline`: one sub-command per DVC stage."""

import importlib
import logging
import os
import secrets
import sys
import time
import traceback
from pathlib import Path

import click

from pipeline import __version__, malloc
from pipeline.tracking import helper as tracking_helper
from pipeline.runtime import forkserver
from pipeline.errors import PipelineError

DEBUG_ENV = "MNIST_PIPELINE_DEBUG"  # =1: every error also shows its traceback
# True in a fork of the warm server (pipeline/runtime/warm_server.py sets it before the command runs): that
# process imported everything, and forked the DDP fork server, already.
in_warm_fork = False

# Sub-command -> its module, imported only when that command runs: compare and send-runs need
# neither torch nor the others' imports, and a stage run by hand is a process of its own (under
# DVC, a fork of the warm server, which imported them all: pipeline/runtime/warm.py).
COMMANDS = {"prepare": "stages.prepare", "commcheck": "stages.commcheck", "train": "stages.train",
            "evaluate": "stages.evaluate", "compare": "stages.compare", "send-runs": "stages.send_runs",
            "rendezvous-check": "stages.rendezvous_check", "reproduce": "stages.reproduce",
            "scaling": "stages.scaling", "sweep": "stages.sweep"}


class PipelineGroup(click.Group):
    """Turns a PipelineError into a one-line message and exit code 1, without a traceback."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return getattr(importlib.import_module(COMMANDS[name]), name.replace("-", "_"))

    def resolve_command(self, ctx: click.Context, args: list[str]):
        """Before the command's module loads (torch, for most): -v for this process and the workers
        it starts, and the processes that import meanwhile: the fork server DDP workers come
        from, or the helper that makes evaluate's and compare's MLflow calls."""
        if ctx.params.get("verbose"):
            from stages.common import VERBOSE_ENV  # only here: this module imports no stage's code

            os.environ[VERBOSE_ENV] = "1"
        try:
            if ctx.resilient_parsing or not args or "--help" in args or "-h" in args:
                pass  # shell completion, or help: nothing will run
            elif in_warm_fork:
                pass  # a fork of the warm server: everything is imported, the DDP fork server forked
            elif launches_local_workers(args[0], args[1:]):
                from stages.common import WORKER_PRELOAD

                name_the_training()
                forkserver.start(WORKER_PRELOAD[args[0]])
            elif logs_after_training(args[0], args[1:]):
                tracking_helper.start()
        except OSError as exc:  # no socket or process to be had: the command starts its own when it needs one
            logging.getLogger(__name__).debug("nothing started ahead: %s", exc)
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PipelineError as exc:
            raise click.ClickException(_shown(exc, str(exc))) from None
        except Exception as exc:
            message = library_failure(exc)
            if message is None:  # a bug: its traceback is the report
                raise
            raise click.ClickException(_shown(exc, message)) from None


def run_in_warm_fork(args: list[str], prog: str) -> None:
    """`mnist-pipeline ARGS` in a fork of the warm server (pipeline/runtime/warm_server.py), which
    imported everything: the DDP fork server is forked now, while this process has run nothing."""
    global in_warm_fork
    in_warm_fork = True
    if launches_local_workers(args[0], args[1:]):
        name_the_training()
        try:
            forkserver.fork_here()
        except OSError:  # the launch starts one the usual way
            pass
    main(args=args, prog_name=prog)


def name_the_training() -> None:
    """The token of the training this command starts, set before the fork server copies the
    environment its workers get (stages.train.pick_up writes it into the training's record)."""
    os.environ.setdefault(forkserver.SNAPSHOT_ENV, secrets.token_hex(8))


def launches_local_workers(name: str, args: list[str]) -> bool:
    """Whether the command will start DDP workers on this machine: commcheck, or train --mode ddp
    (or fsdp), with train.launcher: local and outside torchrun. A wrong guess costs time, not correctness:
    the launch starts the fork server itself when it is not running, and one started for nothing
    ends with this process."""
    if name not in ("train", "commcheck") or any(key in os.environ for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return False
    from pipeline.config import distributed

    config = readable_params(args)
    if config is None or config.train.launcher != "local":
        return False
    if name == "commcheck":
        return config.commcheck.enabled and any(distributed(mode) for mode in config.train.modes)
    if "--mode-of-dvc-stage" in args:
        return distributed(os.environ.get("DVC_STAGE", "").rpartition("@")[2])
    return distributed(option_value(args, "--mode"))


def logs_after_training(name: str, args: list[str]) -> bool:
    """Whether the command is evaluate or compare with tracking on: its MLflow calls then go
    through the helper (pipeline.tracking.helper), which imports MLflow meanwhile."""
    config = readable_params(args) if name in ("evaluate", "compare") else None
    return config is not None and config.tracking.enabled


def readable_params(args: list[str]):
    """The command's params file (--params, else params.yaml); None if it cannot be read, which
    the command itself then reports."""
    from pipeline.config import load_config

    try:
        return load_config(option_value(args, "--params") or "params.yaml")
    except (PipelineError, OSError):
        return None


def option_value(args: list[str], name: str) -> str | None:
    """The value of option `name` in `args` (`--name value` or `--name=value`), None without it."""
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _shown(exc: BaseException, message: str) -> str:
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(exc, file=sys.stderr)
    return message


def library_failure(exc: Exception) -> str | None:
    """The one-line message for an error a library raised about the user's setup (the tracking
    store, the rendezvous), where no stage caught it first; None for anything else."""
    # Through importlib, as the commands are: how an error is worded changes no stage's outputs, so
    # the tracking module must not become every stage's DVC dependency (tests/test_dvc_deps.py).
    tracking = importlib.import_module("pipeline.tracking.store")
    rank = f"rank {os.environ['RANK']}: " if "RANK" in os.environ else ""
    if tracking.from_tracking(exc):
        try:
            with tracking.store_errors(tracking.tracking_uri()):
                raise exc
        except PipelineError as translated:
            return f"{rank}{translated} ({DEBUG_ENV}=1 shows the traceback)"
    text = " ".join(str(exc).split())
    if "NCCL error" in text or "NCCL timeout in:" in text or "ncclSystemError" in text or "WorkNCCL" in text:
        return f"{rank}{nccl_failure(text)} ({DEBUG_ENV}=1 shows the traceback)"
    module = type(exc).__module__
    if module.startswith("torch.distributed") or type(exc).__name__ in ("DistError", "DistStoreError",
                                                                         "DistNetworkError", "RendezvousError"):
        where = (f" through {os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '?')}"
                 if "MASTER_ADDR" in os.environ else "")
        return (f"{rank}torch.distributed could not reach the other ranks{where} "
                f"({' '.join(str(exc).split())[:300]}); check that every node runs the same command and reaches "
                f"the rendezvous address and port, and that no other program holds the port "
                f"({DEBUG_ENV}=1 shows the traceback)")
    return None


def nccl_failure(text: str) -> str:
    """NCCL's own failure (torch raises it as DistBackendError, "NCCL error in: FILE:LINE, REASON,
    NCCL version V", NCCLUtils.hpp; "NCCL timeout in: FILE:LINE" where a communicator's setup timed
    out; or the watchdog's "WorkNCCL(...) timed out"), with its likely
    cause: not a rendezvous problem, which is all torch.distributed's other errors can be here."""
    reason = text.split(", ", 1)[1] if text.startswith("NCCL error in:") and ", " in text else text
    if "Last error:" in reason:  # NCCL's own words on the call that failed: the useful part
        head, _, last = reason.partition("Last error:")
        reason = f"{head.split(' (run with')[0].strip()}: {last.strip()}"
    if text.startswith("NCCL timeout in:"):  # C10D_CHECK_TIMEOUT: a communicator set up without blocking
        reason = "NCCL's communicator setup timed out"
    if "shared memory" in text or "/dev/shm" in text:
        cause = ("/dev/shm too small for NCCL's buffers: a container's default is 64 MB (Docker), so run it "
                 "with --ipc=host or --shm-size=1g")
    elif "unhandled system error" in text:
        cause = ("a system call failed: between nodes, most often the network interface NCCL chose (set "
                 "NCCL_SOCKET_IFNAME) or a firewall; in a container, /dev/shm (--ipc=host)")
    elif text.startswith("NCCL timeout in:"):
        cause = ("a rank did not join in time: it stopped or died first, or cannot reach the others (between nodes: "
                 "NCCL_SOCKET_IFNAME, a firewall)")
    elif "timed out" in text or "Watchdog" in text:
        cause = ("a collective waited past its timeout: a rank stopped or died first (its own message says why), "
                 "or the ranks called collectives in different orders")
    elif "unhandled cuda error" in text:
        cause = "a CUDA error under NCCL: check the GPUs (nvidia-smi) and that each rank has its own"
    else:
        cause = "see NCCL's own reason"
    return (f"NCCL failed ({reason[:300]}): {cause}; set NCCL_DEBUG=WARN (or INFO) for NCCL's own detail")


# How long a failing worker stays before it exits. A fork leaves at once (os._exit), where a fresh
# interpreter took about this long to shut down; torchrun's agent stops every other rank at the
# first exit it sees and names only that one, so without it a peer's own message (rank 0's "the loss
# is not finite at step 12", a rank's "connection closed by peer" after another was killed) would be
# cut off before it is printed, and the rank named would be the quickest to fail, not the first.
FAILURE_GRACE_S = 1.0


def run_worker_command(registry: str, *command: str) -> None:
    """A worker's life, in a fork of the fork server (pipeline.runtime.forkserver): `mnist-pipeline
    <command>`, as a fresh `python -m stages <command>` would run it under torchrun. It returns on
    success (torchrun's agent waits for each worker's return value) and exits non-zero on failure,
    having printed why, as the command does. `registry`: where the launcher finds its workers."""
    forkserver.detach_worker(Path(registry))
    sys.argv = ["mnist-pipeline", *command]
    try:
        main(list(command), prog_name="mnist-pipeline")
    except SystemExit as done:
        if done.code in (0, None):
            return
        time.sleep(FAILURE_GRACE_S)
        raise
    except KeyboardInterrupt:  # outside click's own handling: a failure all the same, never exit 0
        time.sleep(FAILURE_GRACE_S)
        raise SystemExit(130) from None
    except BaseException:  # a bug (no PipelineError): its traceback is the report, as a fresh interpreter's
        traceback.print_exc()
        time.sleep(FAILURE_GRACE_S)
        raise


EPILOG = """\b
Environment:
  MNIST_SOURCE          the folder holding the four MNIST IDX files (default:
                        download them from torchvision's mirrors)
  MLFLOW_TRACKING_URI   where runs go (default: sqlite:///mlflow.db, files in
                        ./mlartifacts)
  MNIST_PIPELINE_DEBUG  =1: an error also prints its traceback
  MNIST_PIPELINE_VERBOSE  =1: the detail too, as -v
  MNIST_PIPELINE_WARM   0: every command in a process of its own; 1: stages
                        in forks of one warm server, by hand too (default:
                        under DVC only; Linux)
\b
Outputs:
  data/prepared/       the splits
  models/<mode>/       model, checkpoint, rank logs, MLflow run ids
  metrics/<mode>.json  the numbers DVC compares (dvc metrics show, make show)
  results/             every figure, per stage and mode
  plots/               curves per epoch and per window of steps, confusion
  reports/             comparison.md and its charts
\b
`dvc repro` runs every stage; `make show` compares experiments; `make ui`
opens MLflow."""


@click.group(cls=PipelineGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EPILOG)
@click.version_option(__version__, prog_name="mnist-pipeline")
@click.option("-v", "--verbose", is_flag=True, help="Print the detail too (commcheck's timings), not only the files.")
def main(verbose: bool) -> None:
    """Train a workload (MNIST by default) under single-device, DataParallel, DistributedDataParallel
    and FSDP, and compare.

    Each command is one DVC stage (dvc.yaml), reading its settings from params.yaml."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Before any tensor: every step then reuses memory the process has (see pipeline.malloc).
    malloc.keep_freed_memory()
