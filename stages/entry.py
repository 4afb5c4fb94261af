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


def project_root(start: Path) -> Path | None:
    """The nearest folder, from `start` up, that holds the project's two packages, where this user
    (or root) owns the folder and both packages and nobody else may write to them: a `pipeline/`
    and `stages/` another user put in a shared folder above (/tmp) must not be run as this user's."""
    for folder in (start, *start.parents):
        if all((folder / package / "__init__.py").is_file() for package in PACKAGES):
            return folder if all(_ours(path) for path in (folder, *(folder / p for p in PACKAGES))) else None
    return None


def _ours(path: Path) -> bool:
    info = path.stat()
    return info.st_uid in (os.geteuid(), 0) and not info.st_mode & 0o002


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
        root = project_root(Path.cwd().resolve())
    except OSError:  # the working directory was removed: let the command say what it can
        root = None
    if root is not None:
        use_code_of(root)
    from stages.warm import main as run

    run()
