"""reproduce: re-make a mode's training from its MLflow run, and say whether it came out bit for bit
(not a DVC stage)."""

import sys
from pathlib import Path

import click

from pipeline import record
from pipeline import reproduce as remake
from pipeline.config import MODES
from pipeline.errors import PipelineError
from pipeline.atomic import read_json
from stages.common import run_ids_file


@click.command(short_help="Re-make a mode's run from its MLflow record; compare the weights.")
@click.argument("run", metavar="RUN_ID|MODE")
def reproduce(run: str) -> None:
    """Train the mode of MLflow run RUN_ID (a `single`, `dp` or `ddp` run; or MODE: the workspace's
    last training of it, as models/MODE/mlflow_run.json names it) again from its record alone: its
    commit checked out in a temporary folder, its uncommitted change applied, its params, world size
    and device type, logged to the same store as a run of its own, linked to it. The workspace and
    models/ are not touched.

    \b
    Exit codes:
      0  reproduced bit for bit (the weights' digests match)
      1  the weights differ: the line says by how much, and what in the record differs
      2  refused: the line says what is missing (run, commit, patch, model, devices, store)
      3  the reproduction itself failed (its training, its checkout): the line says where
      130, 143  stopped by Ctrl-C or SIGTERM: the training it started stopped too (its runs FAILED)"""
    workspace = record.project_folder()  # the project this runs in, from any folder of it
    try:
        with remake.stops_cleanly():
            code, verdict = remake.reproduce(run_id_of(run, workspace), workspace, click.echo)
    except remake.Stopped as stop:
        click.echo(f"reproduce: stopped ({stop}): "
                   + (f"its {stop.during} stopped too (its runs FAILED)" if stop.during else "while nothing ran")
                   + "; its checkout is removed", err=True)
        sys.exit(stop.code)
    except remake.Refusal as exc:
        click.echo(f"reproduce: {exc}", err=True)
        sys.exit(remake.REFUSED)
    except PipelineError as exc:
        click.echo(f"reproduce: failed: {exc}", err=True)
        sys.exit(remake.FAILED)
    click.echo(f"reproduce: {verdict}")
    sys.exit(code)


def run_id_of(run: str, workspace: Path) -> str:
    """RUN_ID as given, or MODE's last training in the workspace."""
    if run not in MODES:
        return run
    ids = workspace / run_ids_file(run)
    parent = read_json(ids, "train that mode again, or give the run's id").get("parent") if ids.is_file() else None
    if not parent:
        raise remake.Refusal(f"{ids}: no {run} training with MLflow runs in this workspace; give the run's id "
                             "(the MLflow UI, or `mnist-pipeline compare`'s links)")
    return parent
