"""A stage with a bug in it, for tests/test_forkserver.py: the fork server imports this module
first (its preload), and importing it makes `mnist-pipeline boom` a command of the server's CLI."""

import os

import click

from stages import cli

cli.COMMANDS["boom"] = __name__


@click.command()
@click.option("--abort", is_flag=True, help="Die of SIGABRT, as NCCL's watchdog takes a rank down.")
def boom(abort: bool) -> None:
    if abort:
        os.abort()
    print(1 / 0)
