"""Options every stage shares."""

import click

params_option = click.option(
    "--params",
    "params_path",
    default="params.yaml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The params file to read settings from.",
)
