"""`dvc repro` again after a failure: an interrupted training goes on in the same MLflow runs when
its settings, data and code are as they were, starts afresh otherwise, and no run stays RUNNING."""

import json

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import SMALL, make_project, project_env, run

PARAMS = {**SMALL, "commcheck": {"enabled": False}, "train": {**SMALL["train"], "modes": ["single", "ddp"]}}


def mode_runs(client: MlflowClient, mode: str) -> list:
    experiments = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(experiments, f"attributes.run_name = '{mode}'", order_by=["start_time ASC"])
    return [(p, client.search_runs(experiments, f"tags.mlflow.parentRunId = '{p.info.run_id}'")) for p in parents]


def statuses(client: MlflowClient) -> dict[str, list[str]]:
    experiments = [e.experiment_id for e in client.search_experiments()]
    found: dict[str, list[str]] = {}
    for r in client.search_runs(experiments, order_by=["start_time ASC"]):
        found.setdefault(r.info.run_name, []).append(r.info.status)
    return found


@pytest.fixture(scope="module")
def project(tmp_path_factory, mnist_dir):
    project = make_project(tmp_path_factory.mktemp("restart") / "proj", PARAMS)
    env = project_env(project, MNIST_SOURCE=str(mnist_dir))
    # Both trainings die right after epoch 1's checkpoint: single as a lost machine would (its
    # process gone, runs left RUNNING), ddp's workers under their launcher (runs ended FAILED).
    crashed = run(["dvc", "repro", "--keep-going"], project, check=False, **env, MNIST_PIPELINE_CRASH_AFTER_EPOCH="1")
    assert crashed.returncode != 0
    return project, env, crashed


def test_the_crash_left_checkpoints_and_unfinished_runs(project):
    project, _, crashed = project
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    assert statuses(client) == {"single": ["RUNNING"], "single/rank-0": ["RUNNING"], "ddp": ["FAILED"],
                                "ddp/rank-0": ["FAILED"], "ddp/rank-1": ["FAILED"]}, crashed.stderr[-3000:]
    for mode in ("single", "ddp"):
        assert torch.load(project / f"models/{mode}/checkpoint.pt", weights_only=True)["epoch"] == 1
        assert (project / f"models/{mode}/unfinished.json").is_file()


@pytest.fixture(scope="module")
def restarted(project):
    project, env, _ = project
    return run(["dvc", "repro"], project, **env)


def test_a_restarted_repro_continues_each_training_in_its_runs(project, restarted):
    project = project[0]
    output = restarted.stdout + restarted.stderr
    for mode, ranks in (("single", 1), ("ddp", 2)):
        assert f"{mode}: continuing the training interrupted in models/{mode}" in output, output[-3000:]
        assert f"{mode} epoch 1/2" not in output and f"{mode} epoch 2/2" in output
        assert not (project / f"models/{mode}/unfinished.json").exists()
        state = torch.load(project / f"models/{mode}/checkpoint.pt", weights_only=True)
        assert state["epoch"] == 2 and len(state["history"]) == 2
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    found = statuses(client)
    assert found == {"single": ["FINISHED"], "single/rank-0": ["FINISHED"], "ddp": ["FINISHED"],
                     "ddp/rank-0": ["FINISHED"], "ddp/rank-1": ["FINISHED"], "compare": ["FINISHED"]}, found
    for mode in ("single", "ddp"):
        [(parent, _)] = mode_runs(client, mode)
        # Both epochs in the one run: epoch 1 from the first attempt, epoch 2 from this one.
        assert [m.step for m in client.get_metric_history(parent.info.run_id, "val_loss")] == [1, 2]
        assert "test_accuracy" in parent.data.metrics  # evaluate logged into the continued run
        ids = json.loads((project / f"models/{mode}/mlflow_run.json").read_text())
        assert ids["parent"] == parent.info.run_id
    # What dvc.lock records is what is there (commcheck is always changed by design).
    status = run(["dvc", "status", "train@single", "train@ddp", "evaluate", "compare"], project)
    assert "up to date" in status.stdout, status.stdout


def test_an_interrupted_training_with_other_settings_starts_afresh(project, restarted):
    project, env, _ = project
    params = project / "params.yaml"
    text = params.read_text()
    assert "lr: 0.02\n" in text
    params.write_text(text.replace("lr: 0.02\n", "lr: 0.03\n"))
    crashed = run(["dvc", "repro", "train@single"], project, check=False, **env, MNIST_PIPELINE_CRASH_AFTER_EPOCH="1")
    assert crashed.returncode != 0
    params.write_text(text.replace("lr: 0.02\n", "lr: 0.04\n"))
    again = run(["dvc", "repro", "train@single"], project, **env)
    assert "the training interrupted in models/single cannot go on: its settings changed (train.lr: 0.03 -> 0.04)" \
        in again.stderr, again.stderr[-3000:]
    assert "single epoch 1/2" in again.stderr and "single epoch 2/2" in again.stderr
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    # The finished training, the interrupted one (ended FAILED, not left RUNNING), the new one.
    assert [p.info.status for p, _ in mode_runs(client, "single")] == ["FINISHED", "FAILED", "FINISHED"]
    assert [[c.info.status for c in children] for _, children in mode_runs(client, "single")] == \
        [["FINISHED"], ["FAILED"], ["FINISHED"]]
    state = torch.load(project / "models/single/checkpoint.pt", weights_only=True)
    assert state["trajectory"]["lr"] == 0.04 and [h["epoch"] for h in state["history"]] == [1, 2]
