"""What the stages after training add to its runs: evaluate's numbers and files on each mode's
run, and compare's own run holding the report. Both go through the tracking helper where one is
running (pipeline.tracking.helper), which makes the same call in its own process. And `make
scaling`'s run, which no stage makes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

from pipeline.config import TrackingConfig
from pipeline.tracking import helper as tracking_helper
from pipeline.tracking.facts import dvc_experiment_facts, git_facts, log_datasets, run_name
from pipeline.tracking.runs import metric_batch, numeric
from pipeline.tracking.store import open_experiment, store_errors, tracking_uri


def log_to_mode_run(config: TrackingConfig, ids: dict, metrics: dict[str, float], artifacts: Iterable[Path],
                    artifact_dir: str | None = None, datasets: tuple[Path, Iterable[str]] | None = None,
                    tags: dict[str, str] | None = None) -> None:
    """Add a later stage's numbers, tags, files and the splits it read (`(data_dir, splits)`) to
    the parent run a training made (see mlflow_run.json)."""
    if not config.enabled or not ids:
        return
    metrics = {key: value for key, value in metrics.items() if isinstance(value, (int, float))}
    if tracking_helper.call("log_to_mode_run", config=dataclasses.asdict(config), ids=ids, metrics=metrics,
                            artifacts=[str(path) for path in artifacts], artifact_dir=artifact_dir,
                            datasets=datasets and (str(datasets[0]), list(datasets[1])), tags=tags) \
            is not tracking_helper.NOT_SENT:
        return
    from mlflow import MlflowClient

    uri = tracking_uri()
    with store_errors(uri, f"logging to run {ids['parent']}"):
        client = MlflowClient(uri)  # in here: it opens the store (a SQL store checks its schema)
        client.log_batch(ids["parent"], metrics=metric_batch(numeric(metrics, step=0)))
        for key, value in (tags or {}).items():
            client.set_tag(ids["parent"], key, value)
        if datasets is not None:
            log_datasets(client, ids["parent"], *datasets)
        for path in artifacts:
            client.log_artifact(ids["parent"], str(path), artifact_dir)


def log_compare_run(config: TrackingConfig, mode_ids: dict[str, dict], artifacts: Iterable[Path]) -> str | None:
    """A `compare` run holding the report, tagged with (and linking to) the mode runs it compares."""
    ids = {mode: value for mode, value in mode_ids.items() if value}
    if not config.enabled or not ids:
        return None
    sent = tracking_helper.call("log_compare_run", config=dataclasses.asdict(config), mode_ids=mode_ids,
                                artifacts=[str(path) for path in artifacts])
    if sent is not tracking_helper.NOT_SENT:
        return sent
    from mlflow import MlflowClient

    uri = tracking_uri()
    experiment_id = next(iter(ids.values()))["experiment_id"]
    # The description (mlflow.note.content) is Markdown in the UI: one link per mode run.
    links = " | ".join(f"[{mode}](#/experiments/{v['experiment_id']}/runs/{v['parent']})" for mode, v in ids.items())
    tags = {f"run_id.{mode}": value["parent"] for mode, value in ids.items()}
    tags.update({"mlflow.note.content": f"Compares the mode runs: {links}", **git_facts(), **dvc_experiment_facts()})
    with store_errors(uri, "logging the compare run"):
        client = MlflowClient(uri)  # in here: it opens the store (a SQL store checks its schema)
        return finished_run(client, experiment_id, "compare", tags, [], artifacts)


def finished_run(client, experiment_id: str, name: str, tags: dict[str, str], metrics: list,
                 artifacts: Iterable[Path]) -> str:
    """A run made whole in one go: its metrics and files, then FINISHED (FAILED if logging fails)."""
    run_id = client.create_run(experiment_id, run_name=run_name(name), tags=tags).info.run_id
    try:
        if metrics:
            client.log_batch(run_id, metrics=metrics)
        for path in artifacts:
            client.log_artifact(run_id, str(path))
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id


def log_scaling_run(config: TrackingConfig, series: dict[str, list[tuple[float, int]]],
                    artifacts: Iterable[Path]) -> str | None:
    """`make scaling`'s run: the curve as metric series whose step is the world size (MLflow's chart
    of a metric against its step is the curve), the picture and the table."""
    if not config.enabled:
        return None
    from mlflow import MlflowClient

    uri = tracking_uri()
    with store_errors(uri, "logging the scaling run"):
        client = MlflowClient(uri)
        points = metric_batch((name, value, step) for name, points in series.items() for value, step in points)
        return finished_run(client, open_experiment(client, config.experiment, uri), "scaling",
                            {**git_facts(), **dvc_experiment_facts()}, points, artifacts)
