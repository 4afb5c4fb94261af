"""The prepared data set: train/val/test as uint8 tensors, plus a JSON that describes them.

uint8 images are 4x smaller than normalised floats; training moves them to the device once and
normalises there with the mean and std recorded here, or (train.loader: dataloader) reads them
sample by sample from the memory-mapped file and normalises each batch there alike.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.atomic import atomic_dir, read_json, write_failed
from pipeline.config import DataConfig
from pipeline.errors import DataError
from pipeline.mnist import NUM_CLASSES, IdxFile, Split

SPLITS = ("train", "val", "test")
STATS_FILE = "stats.json"
PREPARED_FILES = (*(f"{name}.pt" for name in SPLITS), STATS_FILE)  # all that data/prepared holds


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
        for name, split in splits.items():
            try:
                torch.save({"images": split.images.contiguous(), "labels": split.labels}, tmp / f"{name}.pt")
            except (RuntimeError, OSError) as exc:  # torch's writer says a full disk as "unexpected pos ..."
                raise write_failed(out_dir / f"{name}.pt", f"torch.save failed: {_first_line(exc)}") from None
        try:
            (tmp / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
        except OSError as exc:
            raise write_failed(out_dir / STATS_FILE, exc.strerror or str(exc)) from None


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
