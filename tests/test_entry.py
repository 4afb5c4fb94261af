"""`mnist-pipeline` runs the code of the project folder it runs in (stages/entry.py), never the
code another user put in a shared folder above it."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, subprocess_env

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`

INSTALLED = "0.1.0"


def code_copy(folder: Path, version: str) -> Path:
    """`pipeline` and `stages` in `folder`, telling themselves apart by their version."""
    for package in ("pipeline", "stages"):
        shutil.copytree(ROOT / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
    init = folder / "pipeline" / "__init__.py"
    init.write_text(init.read_text().replace(f'"{INSTALLED}"', f'"{version}"'))
    return folder


def started(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    env = subprocess_env()
    env.pop("PYTHONPATH", None)
    return subprocess.run([*(command or ["mnist-pipeline"]), "--version"], cwd=cwd, env=env, capture_output=True,
                          text=True)


def version_in(cwd: Path, *command: str) -> str:
    done = started(cwd, *command)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def test_the_installed_version_is_what_the_copies_replace():
    assert f'__version__ = "{INSTALLED}"' in (ROOT / "pipeline" / "__init__.py").read_text()


def test_a_copy_of_the_project_runs_its_own_code_from_any_folder_in_it(tmp_path):
    project = code_copy(tmp_path / "copy", "9.0.0+copy")
    (project / "reports").mkdir()
    assert version_in(project) == "9.0.0+copy"
    assert version_in(project / "reports") == "9.0.0+copy"
    # python -m stages, as launchers start it, from a folder inside the project (where -m alone
    # would put that folder, not the project, first on sys.path).
    python = str(Path(subprocess_env()["PATH"].split(os.pathsep)[0]) / "python")
    assert version_in(project / "reports", python, "-m", "stages") == "9.0.0+copy"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert version_in(outside) == INSTALLED


def test_a_module_the_copy_lacks_is_not_taken_from_the_installed_checkout(tmp_path):
    """The editable install's finder would answer for a module deleted in the copy with the
    installed checkout's file: the copy's code must fail to import it instead."""
    project = code_copy(tmp_path / "copy", "9.0.0+copy")
    (project / "pipeline" / "errors.py").unlink()
    done = started(project)
    assert done.returncode != 0 and "No module named 'pipeline.errors'" in done.stderr, done.stdout + done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="making files another user's needs root")
def test_packages_another_user_planted_in_a_shared_folder_are_not_run(tmp_path):
    shared = code_copy(tmp_path / "shared", "6.6.6+planted")
    shared.chmod(0o1777)  # as /tmp is
    (shared / "mine").mkdir()
    done = started(shared / "mine")
    assert done.stdout.split()[-1] == INSTALLED and f"anyone may write to {shared}" in done.stderr, done.stderr
    theirs = code_copy(tmp_path / "theirs", "6.6.6+planted")
    for path in (theirs / "pipeline", theirs / "stages"):
        os.chown(path, 65534, 65534)
    (theirs / "mine").mkdir()
    done = started(theirs / "mine")
    assert done.stdout.split()[-1] == INSTALLED and "belongs to uid 65534" in done.stderr, done.stderr
