"""pipeline.runtime.forkserver.fork_here sets up CPython's multiprocessing fork server by hand, through
private attributes that CPython may change; pyproject.toml's requires-python allows only the
versions this test runs it under, each a real interpreter starting a real fork server's worker."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = f"""
import multiprocessing, os, sys
sys.path.insert(0, {str(ROOT)!r})
from pipeline.runtime import forkserver

def child(queue):
    queue.put((os.getppid(), sys.version_info[:2]))

if __name__ == "__main__":
    forkserver.fork_here()
    context = multiprocessing.get_context("forkserver")
    queue = context.SimpleQueue()
    worker = context.Process(target=child, args=(queue,))
    worker.start()
    parent, version = queue.get()
    worker.join()
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert parent == server and worker.exitcode == 0, (parent, server, worker.exitcode)
    print("forked by", server, "under", version)
"""


def allowed_versions() -> list[str]:
    """The minor versions requires-python allows (it is written ">=3.A,<3.B")."""
    text = (ROOT / "pyproject.toml").read_text()
    low, high = map(int, re.search(r'requires-python = ">=3\.(\d+),<3\.(\d+)"', text).groups())
    return [f"3.{minor}" for minor in range(low, high)]


def interpreter(version: str) -> str | None:
    pyenv = sorted(Path("/root/.pyenv/versions").glob(f"{version}.*/bin/python{version}"))
    if pyenv:
        return str(pyenv[-1])
    found = shutil.which(f"python{version}")
    return found if found and "/shims/" not in found else None  # a pyenv shim may name none


@pytest.mark.parametrize("version", allowed_versions())
def test_fork_here_under_each_python_the_project_allows(version, tmp_path):
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this host")
    script = tmp_path / "fork_here.py"
    script.write_text(SCRIPT)
    done = subprocess.run([python, "-I", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1"}, input="")
    assert done.returncode == 0 and f"under ({version.replace('.', ', ')})" in done.stdout, done.stderr[-3000:]
