"""send-runs: what a training kept while the tracking server was away, sent now (not a DVC stage)."""

import click

from pipeline import outbox, tracking
from pipeline.config import MODES
from stages.common import model_dir


@click.command("send-runs")
@click.option("--mode", type=click.Choice(MODES), required=True)
@click.option("--to", "uri", metavar="URI", help="The tracking store to send to (default: MLFLOW_TRACKING_URI, "
                                                 "else the project's mlflow.db); never one a file names.")
@click.option("--discard", is_flag=True, help="Drop what is kept instead of sending it.")
def send_runs(mode: str, uri: str | None, discard: bool) -> None:
    """Send the metrics, files, model and run ends a training kept in models/<mode>/tracking-outbox
    because the tracking server did not answer (or refused them), to the current tracking store."""
    folder = model_dir(mode) / tracking.OUTBOX_DIR
    if discard:
        dropped = outbox.discard(folder)
        click.echo(f"send-runs: {mode}: dropped {dropped} kept tracking calls" if dropped
                   else f"send-runs: {mode}: nothing kept in {folder}")
        return
    sent = tracking.send_kept(folder, uri)
    click.echo(f"send-runs: {mode}: " + (f"sent {sent} kept tracking calls; its runs are complete" if sent
                                          else f"nothing kept in {folder}"))
