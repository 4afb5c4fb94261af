"""evaluate's and compare's MLflow calls, made by the helper process (pipeline.tracking.helper):
the same runs, metrics and files as in the stage's own process, the same one-line errors, and the
call made in the stage itself when the helper is gone."""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest
from mlflow import MlflowClient

from pipeline.tracking import after_training as tracking
from pipeline.tracking import helper as tracking_helper
from pipeline.config import TrackingConfig
from pipeline.errors import PipelineError

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh SQLite store as MLFLOW_TRACKING_URI, a training's parent run in it, and a helper
    started with that environment (as the CLI starts it)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(uri)
    experiment = client.create_experiment("helper", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment, run_name="single").info.run_id
    tracking_helper.start()
    yield client, {"experiment_id": experiment, "parent": parent, "children": {}}
    tracking_helper._stop()


def test_the_helper_logs_what_the_stage_would(store, tmp_path):
    client, ids = store
    report = tmp_path / "report.md"
    report.write_text("# report\n")
    tracking.log_to_mode_run(TrackingConfig(), ids, {"test_accuracy": 0.99, "per_rank": [1, 2]}, [report], "evaluation",
                             tags={"speedup_warning": "too fast"})
    assert tracking_helper._running is not None  # it was the helper's call
    run = client.get_run(ids["parent"])
    assert run.data.metrics == {"test_accuracy": 0.99} and run.data.tags["speedup_warning"] == "too fast"
    assert [a.path for a in client.list_artifacts(ids["parent"], "evaluation")] == ["evaluation/report.md"]
    compare_id = tracking.log_compare_run(TrackingConfig(), {"single": ids, "dp": {}}, [report])
    compared = client.get_run(compare_id)
    assert compared.info.run_name == "compare" and compared.info.status == "FINISHED"
    assert compared.data.tags["run_id.single"] == ids["parent"]


def test_an_error_comes_back_as_the_stage_would_raise_it(store):
    _, ids = store
    missing = {**ids, "parent": "0" * 32}
    with pytest.raises(PipelineError) as through_helper:
        tracking.log_to_mode_run(TrackingConfig(), missing, {"test_accuracy": 0.5}, [])
    tracking_helper._stop()
    with pytest.raises(PipelineError) as in_process:
        tracking.log_to_mode_run(TrackingConfig(), missing, {"test_accuracy": 0.5}, [])
    assert str(through_helper.value) == str(in_process.value)
    assert "0" * 32 in str(in_process.value)


def test_with_the_helper_gone_the_stage_logs_itself(store, caplog):
    client, ids = store
    tracking_helper._running._proc.kill()
    tracking_helper._running._proc.wait()
    tracking.log_to_mode_run(TrackingConfig(), ids, {"test_loss": 0.1}, [], tags={"speedup_warning": "in process"})
    assert "tracking helper process ended" in caplog.text
    assert tracking_helper._running is None
    assert client.get_run(ids["parent"]).data.metrics == {"test_loss": 0.1}
    assert client.get_run(ids["parent"]).data.tags["speedup_warning"] == "in process"


def test_a_store_the_helper_cannot_open_is_the_stages_one_line_error(tmp_path, monkeypatch):
    """Opening the store is part of the call: a schema older than this MLflow's is the advice to
    upgrade it, as in the stage's own process, never the helper's traceback."""
    store = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.create_experiment("helper")
    ids = {"experiment_id": experiment, "parent": client.create_run(experiment).info.run_id, "children": {}}
    with closing(sqlite3.connect(store)) as db, db:
        db.execute("UPDATE alembic_version SET version_num = '451aebb31d03'")  # MLflow 1.x's schema
    tracking_helper.start()
    try:
        with pytest.raises(PipelineError) as error:
            tracking.log_to_mode_run(TrackingConfig(), ids, {"test_accuracy": 0.5}, [])
        assert tracking_helper._running is not None  # the helper's answer, not the stage's own call
    finally:
        tracking_helper._stop()
    assert "its schema is older than this MLflow's" in str(error.value) and "mlflow db upgrade" in str(error.value)
