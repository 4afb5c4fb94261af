"""reproduce: re-make a mode's training from its MLflow run, and say whether it came out bit for bit
(not a DVC stage)."""

import sys
from pathlib import Path

import click

from pipeline import reproduce as remake


@click.command(short_help="Re-make a mode's run from its MLflow record; compare the weights.")
@click.argument("run_id")
def reproduce(run_id: str) -> None:
    """Train the mode of MLflow run RUN_ID (a `single`, `dp` or `ddp` run) again from its record
    alone: its commit checked out in a temporary folder, its uncommitted change applied, its params,
    world size and device type, logged to the same store as a run of its own. The workspace and
    models/ are not touched.

    \b
    Exit codes:
      0  reproduced bit for bit (the weights' digests match)
      1  the weights differ: the line says by how much, and what in the record differs
      2  refused: the line says what is missing (run, commit, patch, devices, store)"""
    try:
        code, verdict = remake.reproduce(run_id, Path.cwd(), click.echo)
    except remake.Refusal as exc:
        click.echo(f"reproduce: {exc}", err=True)
        sys.exit(remake.REFUSED)
    click.echo(f"reproduce: {verdict}")
    sys.exit(code)
