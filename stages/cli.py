"""`mnist-pipeline`: one sub-command per DVC stage."""

import logging

import click

from pipeline import __version__
from pipeline.errors import PipelineError
from stages.commcheck import commcheck
from stages.compare import compare
from stages.evaluate import evaluate
from stages.prepare import prepare
from stages.send_runs import send_runs
from stages.train import train


class PipelineGroup(click.Group):
    """Turns a PipelineError into a one-line message and exit code 1, without a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PipelineError as exc:
            raise click.ClickException(str(exc)) from None


@click.group(cls=PipelineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mnist-pipeline")
def main() -> None:
    """Train MNIST under single-device, DataParallel and DistributedDataParallel, and compare."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")


for command in (prepare, commcheck, train, evaluate, compare, send_runs):
    main.add_command(command)
