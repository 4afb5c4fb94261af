"""send-runs: what a training kept while the tracking server was away, sent now (not a DVC stage)."""

import click

from pipeline import tracking
from pipeline.config import MODES
from stages.common import model_dir


@click.command("send-runs")
@click.option("--mode", type=click.Choice(MODES), required=True)
def send_runs(mode: str) -> None:
    """Send the metrics, files, model and run ends a training kept in models/<mode>/tracking-outbox
    because the tracking server did not answer, to that same server."""
    folder = model_dir(mode) / tracking.OUTBOX_DIR
    sent = tracking.send_kept(folder)
    click.echo(f"send-runs: {mode}: " + (f"sent {sent} kept tracking calls; its runs are complete" if sent
                                          else f"nothing kept in {folder}"))
