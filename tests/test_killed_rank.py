"""A DDP worker killed outright (SIGKILL: the OOM killer, a lost node) cannot end its own MLflow
run; the launcher sees the job fail and ends every run of the training FAILED, whichever rank died."""

import os
import signal
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import (SMALL, ddp_worker_pids, first_epoch_run, make_project, prepare, project_env, run,
                            subprocess_env)


@pytest.mark.parametrize("victim", [0, 1])
def test_every_run_ends_failed_when_a_rank_is_killed(tmp_path, mnist_dir, victim):
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "epochs": 500}})
    prepare(project, mnist_dir)
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


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_killed_fork_server_takes_its_workers_with_it(tmp_path, mnist_dir, sigint):
    """The fork server that started the workers killed under them: the agent can no longer see
    them (it reads each worker's end from the server), so the launcher must make sure they are
    gone before it ends the runs FAILED and lets the next training in: a worker that trained on
    would write model.pt and set its runs FINISHED for a training the stage reported failed.
    SIGINT ignored is how `dvc repro &` in a script starts every command, and no Python handler
    then turns torch's SIGINT on the parent's death into an exit."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else None
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "epochs": 500}})
    prepare(project, mnist_dir)
    proc = subprocess.Popen(["mnist-pipeline", "train", "--mode", "ddp"], cwd=project, text=True,
                            env=subprocess_env(**project_env(project)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=ignore)
    workers = []
    try:
        parent = first_epoch_run(project, "ddp", proc)
        if parent is None:
            pytest.fail(f"training never finished an epoch: {proc.poll() and proc.communicate()[1][-2000:]}")
        workers = list(ddp_worker_pids(proc.pid).values())
        servers = {parent_of(pid) for pid in workers}
        assert len(workers) == 2 and len(servers) == 1, (workers, servers)
        server = servers.pop()
        os.kill(server, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
        alive_at_exit = [pid for pid in workers if is_running(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in workers:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert not alive_at_exit, f"workers {alive_at_exit} outlived the launcher that failed them"
    assert f"the fork server that started the ddp workers (process {server}) was killed by SIGKILL" in stderr, \
        stderr[-2000:]
    assert "see the worker's message above" not in stderr
    assert not (project / "models/ddp/model.pt").exists()
    runs = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_runs([parent.info.experiment_id])
    statuses = {r.info.run_name: r.info.status for r in runs}
    assert statuses == {"ddp": "FAILED", "ddp/rank-0": "FAILED", "ddp/rank-1": "FAILED"}, stderr[-2000:]


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
