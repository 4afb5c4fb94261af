"""send-runs: what a training kept while the tracking server was away, sent now (not a DVC stage)."""

import click

from pipeline import unfinished
from pipeline.runtime import lockfile
from pipeline.config import MODES, load_config
from pipeline.tracking.delivery import OUTBOX_DIR, send_kept
from pipeline.tracking import outbox
from stages.common import model_dir, params_option


@click.command("send-runs", short_help="Send tracking calls an MLflow outage kept.")
@params_option
@click.option("--mode", type=click.Choice(MODES), required=True)
@click.option("--to", "uri", metavar="URI", help="The tracking store to send to (default: MLFLOW_TRACKING_URI, "
                                                 "else the project's mlflow.db); never one a file names.")
@click.option("--discard", is_flag=True, help="Drop what is kept instead of sending it.")
def send_runs(params_path: str, mode: str, uri: str | None, discard: bool) -> None:
    """Send the metrics, files, model and run ends a training kept in models/<mode>/tracking-outbox
    because the tracking server did not answer (or refused them), to the current tracking store."""
    folder = model_dir(mode) / OUTBOX_DIR
    if not (folder.is_dir() or folder.is_symlink()):
        click.echo(f"send-runs: {mode}: nothing kept in {folder}")
        return
    # Not while the mode trains: its outbox is being written.
    with lockfile.held(model_dir(mode), f"send-runs --mode {mode}"):
        if discard:
            dropped = outbox.discard(folder)
            click.echo(f"send-runs: {mode}: dropped {dropped} kept tracking calls" if dropped
                       else f"send-runs: {mode}: nothing kept in {folder}")
            return
        config = load_config(params_path)
        sent = send_kept(folder, uri, config.tracking.registered_model, config.workload.class_path)
        rejected = sorted(folder.glob("*.rejected")) if folder.is_dir() else []
        record = unfinished.unfinished(model_dir(mode))
        if sent is not None and not rejected and unfinished.OUTPUTS_COMPLETE in (record or {}):
            # Its outputs and now its runs are complete: a finished training, never one to continue
            # (`dvc commit` would otherwise cache the record with the outputs).
            (model_dir(mode) / unfinished.UNFINISHED_FILE).unlink()
            click.echo(f"send-runs: {mode}: the training's outputs are complete too: `dvc commit train@{mode}` "
                       "records them")
    click.echo(f"send-runs: {mode}: " + (f"nothing kept in {folder}" if sent is None else
                                          f"sent {sent} kept tracking calls" + (
                                              f"; the lines it could not trust are in {rejected[0].parent}/*.rejected"
                                              if rejected else "; its runs are complete")))
