"""The environment is locked: every package pinned with hashes, generated from the direct
requirements (`make lock`), and the venv holds exactly the lock."""

import re
from importlib import metadata

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`


def pins(path) -> dict[str, str]:
    """name -> version of every `name==version` line (comments and options left out)."""
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9._-]+)==([^\s;\\]+)", line.strip())
        if match:
            found[normalize(match[1])] = match[2]
    return found


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_entries(path) -> list[str]:
    """One string per package in a pip-compile lock: its pin line and its hash lines."""
    return re.split(r"\n(?=[a-z0-9])", path.read_text().split("\n", 1)[1].strip(), flags=re.I)


@pytest.mark.parametrize("direct, lock", [("requirements.txt", "requirements.lock"),
                                          ("requirements-dev.txt", "requirements-dev.lock")])
def test_the_lock_holds_every_direct_requirement_at_its_pinned_version(direct, lock):
    wanted = pins(ROOT / direct)
    if direct == "requirements-dev.txt":
        wanted.update(pins(ROOT / "requirements.txt"))
    locked = pins(ROOT / lock)
    assert wanted and {name: locked.get(name) for name in wanted} == wanted
    assert f"--output-file={lock}" in (ROOT / lock).read_text() and f" {direct}\n" in (ROOT / lock).read_text()


@pytest.mark.parametrize("lock", ["requirements.lock", "requirements-dev.lock"])
def test_every_locked_package_is_pinned_with_hashes(lock):
    entries = [e for e in locked_entries(ROOT / lock) if not e.startswith("#")]
    assert len(entries) > 100  # torch, mlflow and dvc bring well over a hundred
    for entry in entries:
        assert re.match(r"^[A-Za-z0-9._-]+==\S+ \\", entry), entry
        assert "--hash=sha256:" in entry, entry.splitlines()[0]


def test_image_and_venv_locks_agree():
    image, venv = pins(ROOT / "requirements.lock"), pins(ROOT / "requirements-dev.lock")
    assert {name: venv.get(name) for name in image} == image


def test_the_venv_is_exactly_the_lock():
    installed = {normalize(d.metadata["Name"]): d.version for d in metadata.distributions()}
    installed.pop("mnist-pipeline", None)  # the project itself, installed editable
    locked = pins(ROOT / "requirements-dev.lock")
    assert {name: installed.get(name) for name in locked} == locked
    assert set(installed) - set(locked) == set(), "installed but not locked"
