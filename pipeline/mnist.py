"""Read and verify the four MNIST IDX files, from a local folder or torchvision's download.

One loader serves both sources: it takes a folder, finds each file raw or gzipped, checks the IDX
header against the bytes that follow, and (by default) the MD5 of the uncompressed bytes against
the canonical MNIST values, so a wrong or damaged file never reaches training.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import DataError

# MD5 of the *uncompressed* canonical files: the values that identify MNIST whatever the
# compression (torchvision's own MD5s are of its .gz files, which differ between mirrors).
CANONICAL_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
UNSIGNED_BYTE = 0x08
IMAGE_DIMS, LABEL_DIMS = 3, 1
IMAGE_SIZE = (28, 28)  # what the models' first layers are built for
NUM_CLASSES = 10


@dataclass(frozen=True)
class IdxFile:
    path: Path
    tensor: torch.Tensor  # uint8, shape from the header
    md5: str  # of the uncompressed bytes
    size: int  # uncompressed bytes


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # uint8 [N, H, W]
    labels: torch.Tensor  # int64 [N]


def find_idx_file(folder: Path, name: str) -> Path:
    """The file `name` in `folder`, raw or gzipped; a missing file is a DataError naming both."""
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(
        f"{folder}: missing {name} (or {name}.gz); put the four MNIST IDX files in this folder, "
        "or unset MNIST_SOURCE to download them"
    )


def _read_bytes(path: Path) -> bytes:
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as handle:
            return handle.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: not a readable gzip file ({exc}); replace it with a good copy") from None


def parse_idx(path: Path, raw: bytes, expected_dims: int) -> torch.Tensor:
    """The uint8 tensor an IDX file holds, after checking its header against its length."""
    if len(raw) < 4:
        raise DataError(f"{path}: truncated: {len(raw)} bytes is shorter than an IDX header; replace the file")
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    expected_magic = (UNSIGNED_BYTE << 8) | expected_dims
    if zero != 0 or dtype != UNSIGNED_BYTE or ndim != expected_dims:
        raise DataError(
            f"{path}: wrong magic number 0x{int.from_bytes(raw[:4], 'big'):08x}, expected "
            f"0x{expected_magic:08x} (IDX, unsigned bytes, {expected_dims} dimensions); "
            "is this the right file?"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated inside its header; replace the file")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + torch.Size(dims).numel()
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "longer than its header says"
        raise DataError(
            f"{path}: {what}: header {tuple(dims)} needs {expected} bytes, found {len(raw)}; "
            "replace the file with a complete copy"
        )
    # bytearray: torch.frombuffer wants a writable buffer, and the copy is one memcpy.
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=header).reshape(dims)


def read_idx(folder: Path, name: str, expected_dims: int, verify: bool) -> IdxFile:
    path = find_idx_file(folder, name)
    raw = _read_bytes(path)
    md5 = hashlib.md5(raw).hexdigest()
    # The checksum comes first: on canonical MNIST a mismatch explains any header error too.
    if verify and md5 != CANONICAL_MD5[name]:
        raise DataError(
            f"{path}: checksum mismatch: MD5 of the uncompressed bytes is {md5}, canonical MNIST "
            f"has {CANONICAL_MD5[name]}; replace the file with a good copy, or set "
            "data.verify_checksums: false in params.yaml for custom IDX data"
        )
    return IdxFile(path, parse_idx(path, raw, expected_dims), md5, len(raw))


def read_split(folder: Path, split: str, verify: bool) -> tuple[Split, list[IdxFile]]:
    image_name, label_name = SPLIT_FILES[split]
    images = read_idx(folder, image_name, IMAGE_DIMS, verify)
    labels = read_idx(folder, label_name, LABEL_DIMS, verify)
    check_mnist_like(split, images, labels)
    return Split(images.tensor, labels.tensor.long()), [images, labels]


def check_mnist_like(split: str, images: IdxFile, labels: IdxFile) -> None:
    """What training relies on, checked whether or not the checksums are: 28x28 images, as many
    labels as images (at least one), every label a digit. Custom IDX data (verify_checksums off)
    that breaks one of these would otherwise fail late, inside training, with a bare IndexError."""
    if tuple(images.tensor.shape[1:]) != IMAGE_SIZE:
        raise DataError(
            f"{images.path}: images are {'x'.join(map(str, images.tensor.shape[1:]))} pixels, the models take "
            f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}; resize the {split} images to 28x28 (MNIST's size)"
        )
    if len(images.tensor) != len(labels.tensor):
        raise DataError(
            f"{images.path} holds {len(images.tensor)} images but {labels.path} holds "
            f"{len(labels.tensor)} labels; the two files of the {split} split must match"
        )
    if len(labels.tensor) == 0:
        raise DataError(f"{labels.path}: the {split} split is empty; it needs at least one image")
    bad = labels.tensor >= NUM_CLASSES  # uint8: never below 0
    if bad.any():
        first = int(bad.nonzero()[0, 0])
        raise DataError(
            f"{labels.path}: {int(bad.sum())} label(s) outside 0-{NUM_CLASSES - 1} (the first, at index {first}, "
            f"is {int(labels.tensor[first])}); MNIST labels are the digits 0-9: fix the labels file"
        )


def download(root: Path) -> Path:
    """Fetch MNIST through torchvision into `root`; returns the folder holding the IDX files."""
    from torchvision.datasets import MNIST

    try:
        for train in (True, False):
            MNIST(root=str(root), train=train, download=True)
    except Exception as exc:  # torchvision raises bare RuntimeError/URLError for network faults
        raise DataError(
            f"downloading MNIST into {root} failed ({exc}); without a network, set MNIST_SOURCE "
            "to a folder holding the four IDX files"
        ) from None
    return root / "MNIST" / "raw"
