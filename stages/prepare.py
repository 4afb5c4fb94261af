"""prepare: MNIST IDX files -> verified uint8 tensors in data/prepared/."""

import os
from pathlib import Path

import click

from pipeline import mnist
from pipeline.config import load_config
from pipeline.errors import DataError
from pipeline.atomic import check_replaceable
from pipeline.prepared import PREPARED_FILES, describe, save_prepared, split_train_val
from stages.common import params_option


def source_folder(download_root: Path) -> Path:
    source = os.environ.get("MNIST_SOURCE")
    if not source:
        return mnist.download(download_root)
    folder = Path(source)
    if not folder.is_dir():
        raise DataError(f"MNIST_SOURCE={source}: no such folder; point it at the folder holding the IDX files")
    return folder


@click.command(short_help="Read, verify and split MNIST into data/prepared/.")
@params_option
@click.option("--out", default="data/prepared", show_default=True, type=click.Path(file_okay=False))
@click.option("--download-root", default="data/raw", show_default=True, type=click.Path(file_okay=False),
              help="Where torchvision downloads MNIST when MNIST_SOURCE is not set.")
def prepare(params_path: str, out: str, download_root: str) -> None:
    """Read MNIST (MNIST_SOURCE or a download), verify it, split it, write data/prepared/."""
    config = load_config(params_path).data
    check_replaceable(Path(out), PREPARED_FILES)  # before a download, not after
    folder = source_folder(Path(download_root))
    train, train_files = mnist.read_split(folder, "train", config.verify_checksums)
    test, test_files = mnist.read_split(folder, "test", config.verify_checksums)
    train, val = split_train_val(train, config)
    splits = {"train": train, "val": val, "test": test}
    stats = describe(splits, train_files + test_files, verified=config.verify_checksums)
    save_prepared(Path(out), splits, stats)
    counts = ", ".join(f"{name} {len(split.labels)}" for name, split in splits.items())
    checked = "checksums verified" if config.verify_checksums else "checksums NOT verified"
    click.echo(f"prepared {counts} from {folder} ({checked}) -> {out}")
