"""`mnist-pipeline`'s entry point: run the code of the project the command runs in.

The venv installs this project editable, and an editable install maps `pipeline` and `stages` to
the checkout it was made from. DVC runs each experiment in a copy of its own (`dvc exp run --temp`,
`--queue`, `dvc queue start -j N`: folders under .dvc/tmp/exps/), and a stage there imported the
workspace's code, not the copy's, so an experiment queued before an edit ran the edit while MLflow
recorded the queued commit. Here the command finds the project folder it runs in (the working
directory or the nearest folder above it holding `pipeline/` and `stages/`), puts it first on
sys.path, and exports it first on PYTHONPATH for every process it starts: the warm server and its
key, the DDP fork server and its workers, torchrun, the MLflow helper, a Slurm job. Outside any
project, the installed code runs.

Imports only the standard library, and nothing of the project's until the folder is chosen.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGES = ("pipeline", "stages")
# Under DVC every stage runs in a fork of one warm server (pipeline/runtime/warm.py says why): what
# runs a command there and in a process of its own, and what the server imports for all of them.
WARM_APP = {
    "packages": PACKAGES,  # the project's code, which the server's key digests
    "run_in_fork": "stages.cli:run_in_warm_fork",
    "run_here": "stages.cli:main",
    "preload": ("pipeline.tracking",  # first: its MLflow settings come before MLflow reads them
                "mlflow.store.tracking.sqlalchemy_store",  # the default store
                "torch._dynamo",  # torch.optim's first step and use_deterministic_algorithms import it
                "torch.distributed.elastic.multiprocessing",
                "stages.cli", "stages.prepare", "stages.commcheck", "stages.train", "stages.evaluate", "stages.compare",
                "stages.send_runs", "stages.rendezvous_check"),
    # What a command's client does without a running server: "start" one and wait for it; run here
    # and start one "beside" it for the stages that follow (prepare: only torch to import, while
    # the server imports everything on the other core); or just run here (nothing follows compare).
    "without_server": {"prepare": "beside", "commcheck": "start", "train": "start", "evaluate": "start"},
}
MARKERS = ("pipeline/__init__.py", "stages/__init__.py", "stages/entry.py")  # this project's, not any two packages


def project_root(start: Path) -> tuple[Path | None, str | None]:
    """The nearest folder, from `start` up, that holds this project's packages, if this user (or
    root) owns the folder and both packages and nobody else may write to them: a `pipeline/` and
    `stages/` another user put in a shared folder above (/tmp) must not run as this user's code.
    Also why such a folder was passed over (None if none was)."""
    for folder in (start, *start.parents):
        try:
            found = all((folder / marker).is_file() for marker in MARKERS)
        except OSError:  # a folder this user may not read (EACCES): none of its projects
            continue
        if found:
            # workloads/: the project's own workloads, code that runs too, where there is one.
            own = [folder / "workloads"] if (folder / "workloads").is_dir() else []
            for path in (folder, *(folder / package for package in PACKAGES), *own):
                info = path.stat()
                if info.st_uid not in (os.geteuid(), 0):
                    return None, f"{path} belongs to uid {info.st_uid}"
                if info.st_mode & 0o002:
                    return None, f"anyone may write to {path}"
            return folder, None
    return None, None


def use_code_of(root: Path) -> None:
    """Make `root`'s packages the ones this process and its children import."""
    path = str(root)
    sys.path[:] = [path, *(p for p in sys.path if p != path)]
    old = os.environ.get("PYTHONPATH", "")
    rest = [p for p in old.split(os.pathsep) if p and p != path]
    os.environ["PYTHONPATH"] = os.pathsep.join([path, *rest])
    # This module came from the installed checkout; drop what it brought (stages/__init__.py) so the
    # imports below find the chosen folder's.
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
        del sys.modules[name]


def main() -> None:
    try:
        root, passed_over = project_root(Path.cwd().resolve())
    except OSError:  # the working directory was removed: let the command say what it can
        root, passed_over = None, None
    if passed_over:
        print(f"mnist-pipeline: not running the project code found here ({passed_over}); running the installed "
              f"code in {Path(__file__).resolve().parents[1]}", file=sys.stderr)
    if root is not None:
        use_code_of(root)
    from pipeline.runtime import warm

    warm.main(WARM_APP)
