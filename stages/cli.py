"""`mnist-pipeline`: one sub-command per DVC stage."""

import importlib
import logging

import click

from pipeline import __version__, malloc
from pipeline.errors import PipelineError

# Sub-command -> its module, imported only when that command runs: compare and send-runs need
# neither torch nor the others' imports, and every stage is a process of its own.
COMMANDS = {"prepare": "stages.prepare", "commcheck": "stages.commcheck", "train": "stages.train",
            "evaluate": "stages.evaluate", "compare": "stages.compare", "send-runs": "stages.send_runs"}


class PipelineGroup(click.Group):
    """Turns a PipelineError into a one-line message and exit code 1, without a traceback."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return getattr(importlib.import_module(COMMANDS[name]), name.replace("-", "_"))

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
    # Before any tensor: every step then reuses memory the process has (see pipeline.malloc).
    malloc.keep_freed_memory()
