"""The prepared data set: train/val/test as uint8 tensors, plus a JSON that describes them.

uint8 images are 4x smaller than normalised floats; training moves them to the device once and
normalises there with the mean and std recorded here, or (train.loader: dataloader) reads them
sample by sample from the memory-mapped file and normalises each batch there alike.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import Dataset

from pipeline import mnist
from pipeline.atomic import atomic_dir, read_json, write_failed
from pipeline.config import DataConfig
from pipeline.errors import DataError
from pipeline.mnist import IMAGE_SIZE, NUM_CLASSES, IdxFile, Split

SPLITS = ("train", "val", "test")
STATS_FILE = "stats.json"
PREPARED_FILES = (*(f"{name}.pt" for name in SPLITS), STATS_FILE)  # all that data/prepared holds


@dataclass(frozen=True)
class Samples:
    """One split as a workload gives it. `dataset`: map-style, `dataset[i]` is (input, target) as
    tensors; one with `tensors` (torch's TensorDataset) is taken as they are where the split goes
    whole onto the device, any other is read once, sample by sample. `on_device`: what each batch's
    inputs go through once on the device (MNIST: uint8 pixels to normalised floats, 4x less to
    copy), the same function of each sample whatever the batch. `augment`: what a training sample's
    input goes through as it is read, anew every epoch (train.loader: dataloader), its random draws
    from torch's generator seeded by (train.seed, epoch, the sample's index): torchvision's
    transforms as they are, the same draws in every mode, at any world size, on a rerun and a resume;
    validation and test samples are not augmented."""

    dataset: Dataset
    on_device: Callable[[torch.Tensor], torch.Tensor] | None = None
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class Prepared:
    splits: dict[str, Split]
    stats: dict

    @property
    def mean(self) -> float:
        return self.stats["train_pixel_mean"]

    @property
    def std(self) -> float:
        return self.stats["train_pixel_std"]


def normalised(images: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """uint8 pixels [..., H, W] as the models take them: float32 [..., 1, H, W], scaled to [0, 1],
    then standardised. Element by element, so a batch and its images one by one get the same bits."""
    return images.unsqueeze(-3).float().div_(255).sub_(mean).div_(std)


class OnDisk(torch.utils.data.Dataset):
    """A prepared split as a map-style Dataset, its file memory-mapped: only the pages of the samples
    read come into memory. Forked workers share the parent's mapping; pickled (a spawned worker), it
    takes only the path and maps the file itself. A sample is (uint8 image [H, W], label), normalised on the device once it is there
    (`normalised`), as `to_device` does: GPUs divide by a number otherwise than CPUs, to the bit."""

    def __init__(self, data_dir: Path, name: str):
        self.path = Path(data_dir) / f"{name}.pt"
        self._split: Split | None = None
        self.length = len(self._open().labels)

    def _open(self) -> Split:
        if self._split is None:
            try:
                blob = torch.load(self.path, mmap=True, weights_only=True)
                self._split = Split(blob["images"], blob["labels"])
            except Exception as exc:
                raise DataError(f"{self.path}: unreadable ({exc}); run `mnist-pipeline prepare` again") from None
        return self._split

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_split": None}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        split = self._open()
        return split.images[index], split.labels[index]

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole split, read into memory: where it goes onto the device at once."""
        split = load_split(self.path.parent, self.path.stem)
        return split.images, split.labels


def split_train_val(train: Split, config: DataConfig) -> tuple[Split, Split]:
    """A seeded validation split taken from the (optionally limited) training set."""
    images, labels = train.images, train.labels
    if config.train_limit:
        images, labels = images[: config.train_limit], labels[: config.train_limit]
    if config.val_size >= len(labels):
        raise DataError(
            f"data.val_size = {config.val_size} leaves no training images: the training set has "
            f"{len(labels)}; lower data.val_size in params.yaml"
        )
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(config.seed))
    # Sorted, so both splits keep the source order and a split is easy to trace back to it.
    val_idx = order[: config.val_size].sort().values
    train_idx = order[config.val_size :].sort().values
    return Split(images[train_idx], labels[train_idx]), Split(images[val_idx], labels[val_idx])


def describe(splits: dict[str, Split], sources: list[IdxFile], verified: bool) -> dict:
    pixels = splits["train"].images.double() / 255.0
    return {
        "splits": {
            name: {
                "count": len(split.labels),
                "image_shape": list(split.images.shape[1:]),
                "class_counts": torch.bincount(split.labels, minlength=NUM_CLASSES).tolist(),
                "sha256": split_digest(split),
            }
            for name, split in splits.items()
        },
        # Pixels scaled to [0, 1], the scale the model sees before normalisation.
        "train_pixel_mean": round(pixels.mean().item(), 6),
        "train_pixel_std": round(pixels.std().item(), 6),
        "checksums_verified": verified,
        "sources": {f.path.name: {"md5": f.md5, "bytes": f.size} for f in sources},
    }


def split_digest(split: Split) -> str:
    """SHA-256 over a split's pixels and labels (their bytes, in order): what `prepare` made, so a
    file changed after it (in DVC's cache, by hand) is found before anything trains on it."""
    digest = hashlib.sha256()
    for tensor in (split.images, split.labels):
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().numpy())  # its buffer, not a copy: a split may be larger than memory
    return digest.hexdigest()


def check_as_prepared(data_dir: Path, name: str, split: Split, stats: dict) -> None:
    """`split` holds what `prepare` wrote and described in stats.json: its class counts and, from
    stats written since the digest was added, its bytes."""
    described = stats.get("splits", {}).get(name, {})
    counts = torch.bincount(split.labels, minlength=NUM_CLASSES).tolist()
    changed = None
    if described.get("class_counts") is not None and counts != described["class_counts"]:
        changed = f"its class counts are {counts}, {STATS_FILE} says {described['class_counts']}"
    elif described.get("sha256") and split_digest(split) != described["sha256"]:
        changed = f"its contents do not match the SHA-256 in {STATS_FILE}"
    if changed:
        raise DataError(f"{Path(data_dir) / f'{name}.pt'}: changed since `prepare` wrote it ({changed}); run "
                        "`dvc repro --force prepare` (or `mnist-pipeline prepare`) to make it again")


def save_prepared(out_dir: Path, splits: dict[str, Split], stats: dict) -> None:
    with atomic_dir(out_dir, PREPARED_FILES) as tmp:
        write_prepared(tmp, splits, stats)


def write_prepared(folder: Path, splits: dict[str, Split], stats: dict) -> None:
    """The splits and stats.json, written into `folder`, a fresh one that replaces the prepared
    folder whole once complete (pipeline.atomic.atomic_dir): a failure leaves that as it was."""
    left = "the prepared folder is as it was"
    for name, split in splits.items():
        try:
            torch.save({"images": split.images.contiguous(), "labels": split.labels}, folder / f"{name}.pt")
        except (RuntimeError, OSError) as exc:  # torch's writer says a full disk as "unexpected pos ..."
            raise write_failed(folder / f"{name}.pt", f"torch.save failed: {_first_line(exc)}", left) from None
    try:
        (folder / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    except OSError as exc:
        raise write_failed(folder / STATS_FILE, exc.strerror or str(exc), left) from None


def source_folder(download_root: Path) -> Path:
    """Where MNIST's IDX files are: MNIST_SOURCE, or torchvision's download into `download_root`."""
    source = os.environ.get("MNIST_SOURCE")
    if not source:
        return mnist.download(download_root)
    folder = Path(source)
    if not folder.is_dir():
        raise DataError(f"MNIST_SOURCE={source}: no such folder; point it at the folder holding the IDX files")
    return folder


def prepare_mnist(out: Path, raw: Path, config: DataConfig) -> str:
    """MNIST's `prepare` (the Workload default): read and verify the IDX files, split val off train,
    write the splits and stats.json into `out`."""
    folder = source_folder(raw)
    train, train_files = mnist.read_split(folder, "train", config.verify_checksums)
    test, test_files = mnist.read_split(folder, "test", config.verify_checksums)
    train, val = split_train_val(train, config)
    splits = {"train": train, "val": val, "test": test}
    write_prepared(out, splits, describe(splits, train_files + test_files, verified=config.verify_checksums))
    checked = "checksums verified" if config.verify_checksums else "checksums NOT verified"
    return f"{folder} ({checked})"


def mnist_samples(data_dir: Path, name: str) -> Samples:
    """MNIST's `split` (the Workload default): the prepared file, checked against stats.json (its
    images 28x28, its count, class counts and bytes), read as its samples are asked for and
    normalised on the device with the training split's mean and std."""
    data_dir = Path(data_dir)
    stats = load_stats(data_dir)
    split = load_split(data_dir, name, mmap=True)  # readable, and what stats.json says it is
    if tuple(split.images.shape[1:]) != IMAGE_SIZE or not len(split.labels) or \
            len(split.labels) != stats.get("splits", {}).get(name, {}).get("count"):
        raise DataError(
            f"{data_dir / f'{name}.pt'}: holds {len(split.labels)} images of "
            f"{'x'.join(map(str, split.images.shape[1:]))} pixels, not the 28x28 MNIST images {STATS_FILE} "
            "describes; run `mnist-pipeline prepare` (or `dvc repro prepare`) again")
    check_as_prepared(data_dir, name, split, stats)  # its labels and pixels, not only its shape
    return Samples(OnDisk(data_dir, name), functools.partial(
        normalised, mean=stats["train_pixel_mean"], std=stats["train_pixel_std"]))


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def load_split(data_dir: Path, name: str, mmap: bool = False) -> Split:
    """A prepared split; `mmap`: its file memory-mapped, read as its tensors are (a check that goes
    over it once then holds no more of it than the pages the kernel keeps)."""
    path = Path(data_dir) / f"{name}.pt"
    if not path.is_file():
        raise DataError(f"{path}: missing; run `mnist-pipeline prepare` (or `dvc repro prepare`) first")
    try:
        blob = torch.load(path, weights_only=True, mmap=mmap)
        images, labels = blob["images"], blob["labels"]
        if not (isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor) and len(images) == len(labels)):
            raise ValueError("not images and labels of one length")
        return Split(images, labels)
    except Exception as exc:
        raise DataError(f"{path}: unreadable ({exc}); run `mnist-pipeline prepare` again") from None


def load_stats(data_dir: Path) -> dict:
    path = Path(data_dir) / STATS_FILE
    if not path.is_file():
        raise DataError(f"{path}: missing; run `mnist-pipeline prepare` (or `dvc repro prepare`) first")
    return read_json(path, "run `mnist-pipeline prepare` (or `dvc repro prepare`) again")


def load_prepared(data_dir: Path, names: tuple[str, ...] = SPLITS) -> Prepared:
    return Prepared({name: load_split(data_dir, name) for name in names}, load_stats(data_dir))
