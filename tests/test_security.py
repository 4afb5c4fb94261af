"""What the pipeline trusts, and what it sends: params.yaml's text never reaches a shell, an outbox
line cannot upload any file or pick the destination, credentials in a tracking URI are never
printed or written down, a replay never reopens a run, and MLflow's telemetry is off unless asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from mlflow import MlflowClient

from tests.conftest import free_port, make_project, project_env, run, subprocess_env

RUN = "0123456789abcdef0123456789abcdef"


def test_a_mode_in_params_never_reaches_a_shell(tmp_path):
    project = make_project(tmp_path / "proj")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["modes"] = ["single; touch PWNED"]
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for dep in ("checks/comm.json", "data/prepared/stats.json"):  # what DVC wants there before it runs the stage
        (project / dep).parent.mkdir(parents=True, exist_ok=True)
        (project / dep).write_text("{}\n")
    result = run(["dvc", "repro", "--single-item", "train@single; touch PWNED"], project, check=False,
                 **project_env(project))
    assert not (project / "PWNED").exists()
    assert result.returncode != 0 and "DVC_STAGE='train@single; touch PWNED'" in result.stdout + result.stderr


def test_telemetry_is_off_unless_the_user_turns_it_on():
    check = ("import {first}, mlflow; from mlflow.telemetry.utils import is_telemetry_disabled; "
             "print(is_telemetry_disabled())")
    # Without the CI markers MLflow itself reads as "don't send" (CI, PYTEST_CURRENT_TEST, ...).
    env = {key: value for key, value in subprocess_env().items()
           if key not in ("CI", "PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")}

    def disabled(first: str, **extra: str) -> str:
        return subprocess.run([sys.executable, "-c", check.format(first=first)], env={**env, **extra},
                              capture_output=True, text=True, check=True).stdout.strip()

    assert disabled("json") == "False"  # MLflow alone would send
    assert disabled("pipeline.tracking") == "True"
    assert disabled("pipeline.tracking", MLFLOW_DISABLE_TELEMETRY="false") == "False"  # the user's choice wins


def test_credentials_in_a_tracking_uri_are_never_printed_or_written(tmp_path):
    from pipeline.parallel import Rank
    from pipeline.tracking.delivery import outbox_for
    from pipeline.tracking.links import ui_link
    from pipeline.tracking.store import shown

    assert shown("http://alice:s3cret@tracking:5000/x") == "http://alice:***@tracking:5000/x"
    assert shown("http://tracking:5000") == "http://tracking:5000"
    assert ui_link("7", "http://alice:s3cret@tracking:5000/") == \
        "http://tracking:5000/#/experiments/7/runs?workflowType=machine_learning"
    assert shown("API request to http://alice:p#s@s@h:5000/api failed") == "API request to http://alice:***@h:5000/api failed"
    assert shown("http://h:5000/prefix@x") == "http://h:5000/prefix@x"  # an @ in the path is no password
    uri = f"http://alice:s3cret@127.0.0.1:{free_port()}"
    project = make_project(tmp_path / "proj")
    kept_outbox(project, [{"op": "end", "run": RUN, "status": "FINISHED"}], run_ids=(RUN,))
    for command in (["train", "--mode", "single"], ["send-runs", "--mode", "single"], ["compare"]):
        result = run(["mnist-pipeline", *command], project, check=False,
                     **project_env(project, MLFLOW_TRACKING_URI=uri))
        # Refused before MLflow can repeat it: its errors quote the URI they failed on.
        assert result.returncode == 1 and "alice:***@127.0.0.1" in result.stderr, result.stderr
        assert "MLFLOW_TRACKING_USERNAME" in result.stderr and "s3cret" not in result.stdout + result.stderr
        assert "Traceback" not in result.stderr
    result = run(["mnist-pipeline", "send-runs", "--mode", "single", "--to", uri], project, check=False,
                 **project_env(project))
    assert result.returncode == 1 and "--to http://alice:***@127.0.0.1" in result.stderr, result.stderr
    assert "s3cret" not in result.stdout + result.stderr
    box = outbox_for(tmp_path / "models/single/tracking-outbox", Rank(), uri)
    box.put({"op": "end", "run": RUN, "status": "FINISHED"})
    box.close()
    for path in (tmp_path / "models").rglob("*"):
        assert path.is_dir() or "s3cret" not in path.read_text(), path


def kept_outbox(project, lines: list[dict], run_ids: tuple[str, ...] = ()):
    folder = project / "models/single/tracking-outbox"
    folder.mkdir(parents=True)
    if run_ids:  # the training's own runs, as it wrote them when it started
        (folder.parent / "mlflow_run.json").write_text(json.dumps({"experiment_id": "1", "parent": run_ids[0],
                                                                   "children": {}}))
    (folder / "rank-0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    # Where the file says to send: never followed.
    (folder / "rank-0.target").write_text(f"http://127.0.0.1:{free_port()}\n")
    return folder


@pytest.mark.fast
def test_send_runs_sends_to_the_current_store_and_says_so_when_the_runs_are_not_there(tmp_path):
    project = make_project(tmp_path / "proj")
    store = f"sqlite:///{tmp_path / 'current.db'}"
    client = MlflowClient(store)
    experiment = client.create_experiment("e")
    run_id = client.create_run(experiment).info.run_id
    folder = kept_outbox(project, [{"op": "metrics", "run": run_id, "points": [["m", 1.0, 1, 0]]},
                                   {"op": "end", "run": run_id, "status": "FINISHED"}], run_ids=(run_id,))
    sent = run(["mnist-pipeline", "send-runs", "--mode", "single", "--to", store], project, **project_env(project))
    assert "sent 2 kept tracking calls" in sent.stdout and not folder.exists()
    assert client.get_run(run_id).info.status == "FINISHED" and client.get_run(run_id).data.metrics == {"m": 1.0}

    folder = kept_outbox(project, [{"op": "end", "run": RUN, "status": "FINISHED"}], run_ids=(RUN,))  # of another store
    kept = {path.name: path.read_bytes() for path in folder.iterdir()}
    env = project_env(project, MLFLOW_TRACKING_URI=store)
    result = run(["mnist-pipeline", "send-runs", "--mode", "single"], project, check=False, **env)
    assert result.returncode == 1 and "rank-0.jsonl:1: its run is not in the tracking store" in result.stderr, result.stderr
    assert "--discard" in result.stderr and "Traceback" not in result.stderr
    # The refusal keeps the outbox as it was: the next try says the same, until --discard.
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == kept
    dropped = run(["mnist-pipeline", "send-runs", "--mode", "single", "--discard"], project, **env)
    assert "dropped 1 kept tracking calls" in dropped.stdout
    assert not (project / "models/single/tracking-outbox").exists()


@pytest.mark.fast
def test_replaying_a_model_never_reopens_its_run(tmp_path, monkeypatch):
    import torch

    from pipeline.atomic import save_torch
    from pipeline.model import build_model
    from pipeline.tracking.delivery import _deliver

    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())).info.run_id
    client.set_terminated(run_id, "FAILED")
    save_torch(tmp_path / "model.pt", {"state_dict": build_model("small").state_dict(), "model": "small"})
    op = {"op": "model", "run": run_id, "file": str(tmp_path / "model.pt"), "mode": "single",
          "example": torch.zeros(2, 1, 28, 28).tolist(), "registered": None}
    _deliver(client, store, op)
    assert client.get_run(run_id).info.status == "FAILED"  # as the training ended it
    assert [m.name for m in client.search_logged_models(experiment_ids=[client.get_run(run_id).info.experiment_id])]


class Payload:
    """What an attacker who can write to the artifact store plants: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.fast
def test_loading_a_logged_model_never_unpickles_what_is_in_the_store(tmp_path, monkeypatch):
    import mlflow
    import torch

    from pipeline.atomic import save_torch
    from pipeline.model import build_model
    from pipeline.tracking.delivery import _deliver
    from pipeline.tracking.model import load_model

    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())).info.run_id
    trained = build_model("small")
    save_torch(tmp_path / "model.pt", {"state_dict": trained.state_dict(), "model": "small"})
    _deliver(client, store, {"op": "model", "run": run_id, "file": str(tmp_path / "model.pt"), "mode": "single",
                             "example": torch.zeros(2, 1, 28, 28).tolist(), "registered": None})
    mlflow.set_tracking_uri(store)
    loaded = load_model(f"runs:/{run_id}/model")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.state_dict().items())
    assert mlflow.pyfunc.load_model(f"runs:/{run_id}/model").predict(torch.zeros(3, 1, 28, 28).numpy()).shape == (3, 10)

    stored = list((tmp_path / "a").rglob("*.pt")) + list((tmp_path / "a").rglob("*.pth"))
    assert stored  # every tensor file the model holds
    marker = tmp_path / "PWNED"
    for path in stored:
        torch.save({"state_dict": Payload(marker), "model": "small"}, path)
    for load in (load_model, mlflow.pyfunc.load_model):
        try:
            load(f"runs:/{run_id}/model")
        except Exception as exc:
            assert "Weights only load failed" in str(exc) or "weights_only" in str(exc), exc
        else:
            raise AssertionError(f"{load.__module__}.{load.__name__} loaded a planted pickle")
        assert not marker.exists()


def test_the_train_stage_takes_its_mode_from_dvc_stage_wherever_dvc_runs(monkeypatch):
    import pytest

    from pipeline.errors import PipelineError
    from stages.train import stage_mode

    for stage, mode in (("train@ddp", "ddp"), ("../dvc.yaml:train@dp", "dp")):  # the root, or a subfolder
        monkeypatch.setenv("DVC_STAGE", stage)
        assert stage_mode() == mode
    for stage in ("train@single; touch PWNED", "evaluate", ""):
        monkeypatch.setenv("DVC_STAGE", stage)
        with pytest.raises(PipelineError, match="needs a stage train@<mode>"):
            stage_mode()
