"""What the benchmarks share: real MNIST split and normalised as the prepare stage does it."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline import mnist
from pipeline.config import DataConfig
from pipeline.prepared import Split, describe, split_train_val

ROOT = Path(__file__).resolve().parents[1]


def source() -> Path:
    return Path(os.environ.get("MNIST_SOURCE", ROOT.parent / "shared" / "data" / "mnist"))


def splits(config: DataConfig) -> tuple[dict[str, Split], float, float]:
    """({"train", "val", "test"} splits, pixel mean, pixel std): the prepare stage's split of the
    training images and its normalisation, so a benchmark trains what the pipeline trains."""
    train_full, _ = mnist.read_split(source(), "train", verify=True)
    test, _ = mnist.read_split(source(), "test", verify=True)
    train, val = split_train_val(train_full, config)
    stats = describe({"train": train}, [], verified=True)
    return {"train": train, "val": val, "test": test}, stats["train_pixel_mean"], stats["train_pixel_std"]
