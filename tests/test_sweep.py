"""`mnist-pipeline sweep`: the grid, its checks against params.yaml, and the refusals that submit
nothing. The sweep on a real Slurm cluster is in tests/test_multinode.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline import sweep
from pipeline.errors import ConfigError
from tests.conftest import ROOT, VENV_BIN, run, subprocess_env

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`

RAW = yaml.safe_load((ROOT / "params.yaml").read_text())


def test_the_grid_crosses_every_key_with_every_other_in_the_order_given():
    found = sweep.experiments(RAW, ["train.lr=0.01,0.03", "train.epochs=1,2", "train.optimizer=sgd"], "lr")
    assert [e.name for e in found] == ["lr-1", "lr-2", "lr-3", "lr-4"]
    assert [e.overrides for e in found] == [
        ("train.lr=0.01", "train.epochs=1", "train.optimizer=sgd"), ("train.lr=0.01", "train.epochs=2", "train.optimizer=sgd"),
        ("train.lr=0.03", "train.epochs=1", "train.optimizer=sgd"), ("train.lr=0.03", "train.epochs=2", "train.optimizer=sgd")]
    merged = sweep.apply(RAW, found[3].overrides, "params.yaml")
    assert (merged["train"]["lr"], merged["train"]["epochs"]) == (0.03, 2) and RAW["train"]["lr"] != 0.03  # a copy
    nested = sweep.apply(RAW, ("workload.init_args.model=classic",), "params.yaml")
    assert nested["workload"]["init_args"]["model"] == "classic"


@pytest.mark.parametrize("options, says", [
    ([], "nothing to sweep: give at least one -S KEY=V1,V2"),
    (["train.lr"], "expected KEY=VALUE or KEY=V1,V2"),
    (["train.lr=0.1,"], "an empty value"),
    (["train.lr=0.1", "train.lr=0.2"], "-S train.lr is given twice"),
    (["train.learning_rate=0.1,0.2"], "params.yaml has no key 'train.learning_rate'"),
    (["train.epochs=1,two"], "train.epochs = 'two' has the wrong type; allowed: an integer"),
    (["train.optimizer=adam,lion"], "train.optimizer = 'lion' is not allowed"),
])
def test_a_grid_params_yaml_refuses_is_one_line_naming_the_override(options, says):
    with pytest.raises(ConfigError) as refused:
        sweep.experiments(RAW, options, "grid")
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["a..b", "x.lock", "-x", "a/b", "n" * 101])
def test_a_name_that_makes_no_git_ref_is_refused(name):
    with pytest.raises(ConfigError, match="as a DVC experiment's name"):
        sweep.experiments(RAW, ["train.lr=0.1"], name)


@pytest.mark.parametrize("written, queued, state", [
    (None, "PENDING", "queued"),
    ({"state": "running"}, "RUNNING", "running"),
    (None, "RUNNING", "running"),  # started, not yet written
    ({"state": "done"}, None, "done"),
    ({"state": "failed"}, None, "failed"),
    ({"state": "running"}, None, "failed"),  # gone from the queue without a word: killed, or its node failed
    (None, None, "failed"),
    ({"state": "running"}, "CANCELLED", "failed"),
])
def test_an_experiments_state_from_its_file_and_slurms_queue(written, queued, state):
    assert sweep.state(written, queued) == state


@pytest.fixture
def project(tmp_path) -> Path:
    """A git repository with the project's params.yaml and a remote the sweep could push to."""
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    run(["git", "init", "-q", "-b", "main"], folder)
    run(["git", "add", "params.yaml"], folder)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "params"], folder)
    run(["git", "init", "-q", "--bare", str(tmp_path / "remote.git")], tmp_path)
    run(["git", "remote", "add", "origin", str(tmp_path / "remote.git")], folder)
    return folder


def sweep_cli(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mnist-pipeline", "sweep", *args], cwd=project, capture_output=True, text=True,
                          env=subprocess_env(**env))


UNTRACKED = ["-S", "tracking.enabled=false"]  # no tracking server needed for the checks after it


@pytest.mark.parametrize("case, args, says", [
    ("", ["-S", "train.lr=0.1,x"], "train.lr = 'x' has the wrong type"),
    ("", ["-S", "train.nodes=2"], "each experiment of a sweep runs in one job on one node"),
    ("", ["-S", "train.lr=0.1,0.2"], "the tracking store is sqlite:///"),
    ("dirty", [*UNTRACKED, "-S", "train.lr=0.1,0.2"], "uncommitted changes (M params.yaml ...)"),
    ("no remote", [*UNTRACKED, "-S", "train.lr=0.1,0.2"], "no git remote 'origin' here"),
    ("gone remote", [*UNTRACKED, "-S", "train.lr=0.1,0.2"], "git remote 'origin' ("),
    ("no sbatch", [*UNTRACKED, "-S", "train.lr=0.1,0.2"], "sbatch is not on PATH"),
    ("", ["--name", "a b", "-S", "train.lr=0.1,0.2"], "--name 'a b': use up to 100 letters, digits"),
])
def test_bad_input_submits_nothing_and_says_why_in_one_line(project, tmp_path, case, args, says):
    env = {}
    if case == "dirty":
        (project / "params.yaml").write_text((project / "params.yaml").read_text() + "\n")
    elif case == "no remote":
        run(["git", "remote", "remove", "origin"], project)
    elif case == "gone remote":
        run(["git", "remote", "set-url", "origin", str(tmp_path / "gone.git")], project)
    elif case == "no sbatch":
        tools = tmp_path / "bin"  # git, and no Slurm
        tools.mkdir()
        (tools / "git").symlink_to(shutil.which("git"))
        env["PATH"] = f"{VENV_BIN}:{tools}"
    refused = sweep_cli(project, *args, **env)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and says in lines[0], refused.stderr
    assert not (project / ".sweeps").exists()
    assert "refs/sweeps" not in run(["git", "ls-remote", str(tmp_path / "remote.git")], tmp_path).stdout
