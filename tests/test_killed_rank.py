"""A DDP worker killed outright (SIGKILL: the OOM killer, a lost node) cannot end its own MLflow
run; the launcher sees the job fail and ends every run of the training FAILED, whichever rank died."""

import os
import signal
import subprocess
import time

import pytest
from mlflow import MlflowClient

from tests.conftest import SMALL, ddp_worker_pids, make_project, project_env, run, subprocess_env


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
        os.kill(ddp_worker_pids(proc.pid)[victim], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"rank {victim} (exit code -9)" in stderr or f"rank {victim} (exit code 137)" in stderr, stderr[-2000:]
    runs = client.search_runs([found[0].info.experiment_id])
    statuses = {r.info.run_name: r.info.status for r in runs}
    assert statuses == {"ddp": "FAILED", "ddp/rank-0": "FAILED", "ddp/rank-1": "FAILED"}, stderr[-2000:]
