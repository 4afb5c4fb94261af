"""What every stage shares: the params option and where each mode's outputs live."""

import os
from pathlib import Path

import click

from pipeline.atomic import read_json

VERBOSE_ENV = "MNIST_PIPELINE_VERBOSE"  # =1, or `mnist-pipeline -v`: the detail on the terminal too
# What the DDP workers' fork server imports for each command's workers, once (pipeline/runtime/preloaded.py
# says why; pipeline/runtime/forkserver.py starts it).
WORKER_PRELOAD = {"commcheck": ["pipeline.runtime.preloaded", "stages.commcheck"],
                  # torch.optim and torch.use_deterministic_algorithms import torch._dynamo on first use.
                  "train": ["pipeline.runtime.preloaded", "torch._dynamo", "stages.train"]}


def verbose() -> bool:
    """Set by `mnist-pipeline -v` for this process and the workers it starts."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def echo_detail(text: str) -> None:
    """What a person reads in the files unless they ask for it here (-v)."""
    if verbose():
        click.echo(text)


params_option = click.option(
    "--params",
    "params_path",
    default="params.yaml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The params file to read settings from.",
)


def model_dir(mode: str) -> Path:
    return Path("models") / mode


def run_ids_file(mode: str) -> Path:
    """The ids of the MLflow runs a mode's training made, so evaluate and compare log into them."""
    return model_dir(mode) / "mlflow_run.json"


def read_run_ids(mode: str) -> dict:
    """{} when the mode was trained with tracking off (or before tracking existed)."""
    path = run_ids_file(mode)
    if not path.is_file():
        return {}
    return read_json(path, f"it names the MLflow runs of the {mode} training: train that mode again, or delete "
                           "the file to go on without logging to those runs")
