"""Single-machine failure modes: each ends with one clear message, a non-zero exit and no run left
RUNNING, never with a green stage on a broken model."""

import json
import os
import shutil
import subprocess

import pytest
import torch
import yaml
from mlflow import MlflowClient

from tests.conftest import SMALL, make_project, prepare, project_env, run, subprocess_env, train_cli


@pytest.fixture(scope="module")
def project(tmp_path_factory, mnist_dir):
    project = make_project(tmp_path_factory.mktemp("failures") / "proj", SMALL)
    prepare(project, mnist_dir)
    return project


def params_with(project, name: str, **train) -> str:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(train)
    (project / name).write_text(yaml.safe_dump(params, sort_keys=False))
    return name


@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_a_diverged_training_stops_naming_mode_epoch_and_step(project, mode):
    # Adam's steps are about lr in size: at 1e30 the logits overflow float32 within a few steps.
    params = params_with(project, "diverge.yaml", lr=1e30)
    result = train_cli(project, mode, "--params", params, check=False)
    assert result.returncode != 0
    assert f"{mode}: the training loss is not finite at epoch 1, step " in result.stderr, result.stderr[-2000:]
    assert "training diverged. Lower train.lr" in result.stderr
    assert "Traceback" not in result.stderr
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    parent = client.search_runs(experiments, f"attributes.run_name = '{mode}'", order_by=["start_time DESC"])[0]
    children = client.search_runs(experiments, f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert parent.info.status == "FAILED" and len(children) == (2 if mode == "ddp" else 1)
    assert {child.info.status for child in children} == {"FAILED"}


def test_the_quality_gate_fails_evaluate_on_a_broken_model(project):
    # A learning rate this small leaves the model where it started: about one digit in ten right.
    params = params_with(project, "stuck.yaml", lr=1e-7)
    train_cli(project, "single", "--params", params)
    result = run(["mnist-pipeline", "evaluate", "--mode", "single", "--params", params], project, check=False,
                 **project_env(project))
    assert result.returncode == 1
    assert "is below evaluate.min_test_accuracy = 50.00%: the model is broken or undertrained" in result.stderr
    assert "Traceback" not in result.stderr
    accuracy = json.loads((project / "results/eval/single.json").read_text())["accuracy"]
    assert accuracy < 0.5


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare to mount a small or read-only models/ (CI runs as root)")


def in_private_mount(project, mount: str, script: str) -> subprocess.CompletedProcess:
    """`script` in a mount namespace of its own where `mount` is mounted over models/: the mount
    goes away with the process, whatever happens."""
    (project / "models").mkdir(exist_ok=True)
    return subprocess.run(["unshare", "--mount", "sh", "-c", f"mount {mount} models && {script}"], cwd=project,
                          env=subprocess_env(**project_env(project)), capture_output=True, text=True)


@needs_root
def test_a_read_only_models_folder_fails_before_training(project):
    result = in_private_mount(project, "-t tmpfs -o ro,size=1m tmpfs", "exec mnist-pipeline train --mode single")
    assert result.returncode == 1
    assert "models/single: cannot write into it (Read-only file system)" in result.stderr
    assert "epoch 1/" not in result.stderr and "Traceback" not in result.stderr


@needs_root
def test_a_full_disk_keeps_the_previous_checkpoint(project, tmp_path):
    # The checkpoint (weights and Adam's two moments, about 2.5 MB) fits once in 4 MB, not twice:
    # epoch 2's save runs out of space while epoch 1's checkpoint is still there.
    after = tmp_path / "after"
    result = in_private_mount(project, "-t tmpfs -o size=4m tmpfs",
                              f"mnist-pipeline train --mode single; rc=$?; cp -a models/. {after}/; exit $rc")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "models/single/checkpoint.pt: could not be written (" in result.stderr
    assert "the previous checkpoint.pt is intact" in result.stderr and "Traceback" not in result.stderr
    state = torch.load(after / "single/checkpoint.pt", weights_only=True)
    assert state["epoch"] == 1
    assert not [p.name for p in (after / "single").iterdir() if p.name.endswith(".tmp")]
