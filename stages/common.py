"""Options and steps every stage shares."""

import sys

import click

from pipeline import parallel
from pipeline.config import Config

params_option = click.option(
    "--params",
    "params_path",
    default="params.yaml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The params file to read settings from.",
)


def launch_workers(config: Config, command: list[str]) -> None:
    """Run `mnist-pipeline <command>` as one worker per device, as torchrun would."""
    nproc = config.train.nproc or parallel.default_nproc()
    click.echo(f"{command[0]}: launching {nproc} workers")
    parallel.launch_workers(nproc, [sys.executable, "-m", "pipeline", *command])
