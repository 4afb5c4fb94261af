"""The MLflow UI's pages for a training's runs: printed by `make ui` and by compare."""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path
from typing import Iterable

from pipeline.config import MODES, load_config
from pipeline.errors import PipelineError

UI_DEFAULT = "http://127.0.0.1:5000"  # where `make ui` serves the default store


def print_ui_link() -> None:
    """For `make ui`: the links to the last training in this checkout: its runs, every mode side
    by side, and each distributed mode's ranks side by side."""
    trained = {}
    for mode in listed_modes():  # a mode dropped from train.modes may have runs of another experiment
        path = Path("models") / mode / "mlflow_run.json"
        ids = json.loads(path.read_text()) if path.is_file() else {}
        if ids.get("parent"):  # {}: trained with tracking off
            trained[mode] = ids
    if not trained:
        print(f"MLflow UI: {UI_DEFAULT} (nothing tracked yet: make run)")
        return
    experiment = next(iter(trained.values()))["experiment_id"]
    print(f"MLflow: the mode runs side by side at {ui_link(experiment)}")
    modes = [mode for mode in trained if trained[mode]["experiment_id"] == experiment]
    print(f"MLflow: the last training's modes compared at {compare_link(experiment, [trained[m]['parent'] for m in modes])}")
    for mode in modes:
        ranks = trained[mode].get("children", {})
        if len(ranks) > 1:
            print(f"MLflow: the {mode} ranks compared at {compare_link(experiment, ranks.values())}")


def listed_modes() -> tuple[str, ...]:
    """params.yaml's train.modes; every mode where it cannot be read (make ui is no place to fail)."""
    try:
        return load_config("params.yaml").train.modes
    except (PipelineError, OSError):
        return MODES


def _ui_base(uri: str | None) -> str:
    """The UI of the server in MLFLOW_TRACKING_URI, or `make ui`'s for the default store."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "")  # not tracking_uri(): a link is no use of the account
    if not uri.startswith(("http://", "https://")):
        return UI_DEFAULT
    parts = urllib.parse.urlsplit(uri)  # a link to print: the browser asks for the account itself
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])).rstrip("/")


def ui_link(experiment_id: str, uri: str | None = None) -> str:
    """The page that shows this experiment's training runs."""
    return f"{_ui_base(uri)}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def compare_link(experiment_id: str, run_ids: Iterable[str], uri: str | None = None) -> str:
    """MLflow's compare page for these runs: every param and metric side by side."""
    # Percent-encoded: a terminal ends a link at a bracket or quote, MLflow's page decodes them.
    def encoded(values: Iterable[str]) -> str:
        return urllib.parse.quote(json.dumps(list(values), separators=(",", ":")), safe=",")

    return (f"{_ui_base(uri)}/#/compare-runs?runs={encoded(run_ids)}&experiments={encoded([experiment_id])}"
            "&workflowType=machine_learning")
