"""A DDP worker killed outright (SIGKILL: the OOM killer, a lost node) cannot end its own MLflow
run; the launcher sees the job fail and ends every run of the training FAILED, whichever rank died."""

import os
import signal
import subprocess

import pytest
from mlflow import MlflowClient

from tests.conftest import SMALL, ddp_worker_pids, first_epoch_run, make_project, project_env, run, subprocess_env


@pytest.mark.parametrize("victim", [0, 1])
def test_every_run_ends_failed_when_a_rank_is_killed(tmp_path, mnist_dir, victim):
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "epochs": 500}})
    run(["mnist-pipeline", "prepare"], project, **project_env(project, MNIST_SOURCE=str(mnist_dir)))
    proc = subprocess.Popen(["mnist-pipeline", "train", "--mode", "ddp"], cwd=project, text=True,
                            env=subprocess_env(**project_env(project)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        parent = first_epoch_run(project, "ddp", proc)
        if parent is None:
            pytest.fail(f"training never finished an epoch: {proc.poll() and proc.communicate()[1][-2000:]}")
        os.kill(ddp_worker_pids(proc.pid)[victim], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"rank {victim} (exit code -9)" in stderr or f"rank {victim} (exit code 137)" in stderr, stderr[-2000:]
    runs = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_runs([parent.info.experiment_id])
    statuses = {r.info.run_name: r.info.status for r in runs}
    assert statuses == {"ddp": "FAILED", "ddp/rank-0": "FAILED", "ddp/rank-1": "FAILED"}, stderr[-2000:]
