"""A DDP worker killed outright (SIGKILL: the OOM killer, a lost node) cannot end its own MLflow
run; the launcher sees the job fail and ends every run of the training FAILED, whichever rank died."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import SMALL, make_project, project_env, run, subprocess_env


def worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's training workers, read from their environment."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode().split("\0") if "=" in item)
            status = (proc / "status").read_text()
        except (OSError, ValueError):
            continue
        parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if parent == launcher and "RANK" in environ:
            found[int(environ["RANK"])] = int(proc.name)
    return found


@pytest.mark.parametrize("victim", [0, 1])
def test_every_run_ends_failed_when_a_rank_is_killed(tmp_path, mnist_dir, victim):
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "epochs": 500}})
    run(["mnist-pipeline", "prepare"], project, **project_env(project, MNIST_SOURCE=str(mnist_dir)))
    proc = subprocess.Popen(["mnist-pipeline", "train", "--mode", "ddp"], cwd=project, text=True,
                            env=subprocess_env(**project_env(project)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # until the first epoch is logged
            try:
                found = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                           "attributes.run_name = 'ddp'")
            except Exception:  # no store yet, or its schema is being made
                found = []
            if found and "val_loss" in found[0].data.metrics:
                break
            time.sleep(0.5)
        else:
            pytest.fail("training never finished an epoch")
        os.kill(worker_pids(proc.pid)[victim], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"rank {victim} (exit code -9)" in stderr or f"rank {victim} (exit code 137)" in stderr, stderr[-2000:]
    runs = client.search_runs([found[0].info.experiment_id])
    statuses = {r.info.run_name: r.info.status for r in runs}
    assert statuses == {"ddp": "FAILED", "ddp/rank-0": "FAILED", "ddp/rank-1": "FAILED"}, stderr[-2000:]
