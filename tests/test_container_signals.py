"""`docker stop` ends a run cleanly: the image's entrypoint, as PID 1 of a new PID namespace (what a
container is), gets SIGTERM mid-training; the whole process tree exits within seconds and every
MLflow run of the training ends FAILED, none left RUNNING."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import ROOT, SMALL, first_epoch_run, make_project, project_env, scaled, subprocess_env

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and util-linux unshare to make a PID namespace (CI runs as root)")


def forked_child(pid: int, timeout: float = 10) -> int:
    """The one process `pid` forked: PID 1 of the namespace `unshare --fork` made."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if found:
            return int(found[0])
        time.sleep(0.05)
    raise AssertionError(f"unshare ({pid}) forked nothing in {timeout} s")


def test_sigterm_to_the_containers_pid_1_ends_every_run_failed(tmp_path, mnist_dir):
    params = {**SMALL, "train": {**SMALL["train"], "modes": ["ddp"], "epochs": 500}}
    project = make_project(tmp_path / "proj", params)
    env = subprocess_env(**project_env(project, MNIST_SOURCE=str(mnist_dir)))
    # No arguments: the entrypoint's default, `dvc repro`, exactly as the image runs it.
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", str(ROOT / "docker/entrypoint.sh")],
                            cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid_1 = forked_child(proc.pid)  # what the container's runtime signals on `docker stop`
    try:
        parent = first_epoch_run(project, "ddp", proc, timeout=300)
        assert parent is not None, "training never finished an epoch"
        assert Path(f"/proc/{pid_1}/comm").read_text().strip() == "dumb-init"
        os.kill(pid_1, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=scaled(60))  # a hang, not a busy host's slow exit
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process tree was still running {scaled(60):.0f} s after SIGTERM to PID 1")
    finally:
        if proc.poll() is None:
            os.kill(pid_1, signal.SIGKILL)  # the namespace's init: everything in it goes with it
            proc.communicate(timeout=30)
    assert proc.returncode != 0
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([parent.info.experiment_id], "attributes.run_name LIKE 'ddp%'")
    statuses = {r.info.run_name: r.info.status for r in runs}
    assert set(statuses) == {"ddp", "ddp/rank-0", "ddp/rank-1"}
    assert set(statuses.values()) == {"FAILED"}, (statuses, output[-3000:])
    everything = client.search_runs([parent.info.experiment_id])
    assert not [r.info.run_name for r in everything if r.info.status == "RUNNING"]
