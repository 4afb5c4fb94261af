"""Image classification over a folder of images on disk, in the layout a team's own images come in
(torchvision's ImageFolder: one sub-folder per class), read by DataLoader workers as the steps need
them, and augmented per sample, seeded, so that the modes and reruns still agree:

    workload:
      class_path: pipeline.workloads.images.ImageFolderClassifier
      init_args: {root: data/images, classes: 10, image_size: 32, channels: 3}
    train:
      loader: dataloader        # augmentation happens as the workers read the samples

`prepare` reads every image under `root` (PNG, JPEG, ...: what Pillow reads), converts it to
`channels` (1: grey, 3: RGB) and `image_size` square, and writes each split as PNGs in the same
layout (data/prepared/<split>/<class>/...), with an index per split and stats.json: the classes, the
training images' mean and std per channel, and a SHA-256 of each split. A file that does not decode
is named, and nothing is written. The network is a small ResNet (three residual stages); its
normalisation is per sample (GroupNorm) unless `norm: batch`, with which DDP's ranks normalise their
own shares and the modes no longer agree (docs/workloads.md says where equivalence holds).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import DataConfig
from pipeline.errors import DataError
from pipeline.workloads import Samples, Workload

SPLITS = ("train", "val", "test")
NORMS = ("group", "batch")


class ImageFolderClassifier(Workload):
    """`root`: the folder of class folders, relative to the project; `classes`: how many it holds.
    `val_fraction` and `test_fraction` of the images go to validation and test (data.seed draws
    which). `augment`: each training image is shifted by up to `image_size // 8` pixels (a padded
    random crop) every epoch, and mirrored left to right half the time with `flip` (photos, not
    digits or text)."""

    def __init__(self, root: str, classes: int, image_size: int = 32, channels: int = 3, width: int = 16,
                 norm: str = "group", augment: bool = True, flip: bool = False,
                 val_fraction: float = 0.1, test_fraction: float = 0.1):
        if not (isinstance(classes, int) and classes >= 2):
            raise ValueError(f"classes = {classes!r}: allowed: the number of class folders, at least 2")
        if channels not in (1, 3):
            raise ValueError(f"channels = {channels!r}: allowed: 1 (grey) or 3 (RGB)")
        if not (isinstance(image_size, int) and image_size >= 8):
            raise ValueError(f"image_size = {image_size!r}: allowed: a whole number of pixels, at least 8")
        if not (isinstance(width, int) and width >= 8 and width % 8 == 0):
            raise ValueError(f"width = {width!r}: allowed: a multiple of 8 (GroupNorm's groups), at least 8")
        if norm not in NORMS:
            raise ValueError(f"norm = {norm!r}: allowed: one of {NORMS}")
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError("val_fraction and test_fraction: each above 0, together below 1")
        self.root, self.classes, self.image_size, self.channels = Path(root), classes, image_size, channels
        self.width, self.norm, self.augment, self.flip = width, norm, augment, flip
        self.val_fraction, self.test_fraction = val_fraction, test_fraction

    # The model and its loss: cross-entropy summed over the samples, accuracy as the count of right answers.
    def build_model(self) -> nn.Module:
        return SmallResNet(self.channels, self.classes, self.width, self.norm)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets, reduction="sum")

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"accuracy": (outputs.argmax(1) == targets).sum()}

    def example_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, self.channels, self.image_size, self.image_size), torch.tensor([0, 1])

    # Its data.
    def prepare(self, out: Path, raw: Path, data: DataConfig) -> str:
        if not self.root.is_dir():
            raise DataError(f"{self.root}: no such folder; set workload.init_args.root to a folder of class folders "
                            "(root/<class>/<image>), relative to the project")
        try:
            found = _ImageFolder(str(self.root), allow_empty=False)
        except (FileNotFoundError, NotADirectoryError) as exc:  # no class folder, or one without an image
            raise DataError(f"{self.root}: {exc}") from None
        if len(found.classes) != self.classes:
            raise DataError(f"{self.root}: {len(found.classes)} class folders ({', '.join(found.classes[:12])}), "
                            f"not workload.init_args.classes = {self.classes}; make them agree")
        files = [(Path(path).relative_to(self.root), label) for path, label in found.samples]
        order = torch.randperm(len(files), generator=torch.Generator().manual_seed(data.seed))
        val, test = round(len(files) * self.val_fraction), round(len(files) * self.test_fraction)
        if min(val, test, len(files) - val - test) < 1:
            raise DataError(f"{self.root}: {len(files)} images leave a split empty; add images or change "
                            "val_fraction and test_fraction")
        parts = {"val": order[:val], "test": order[val:val + test], "train": order[val + test:]}
        source = hashlib.sha256()
        stats = {"source": {"root": str(self.root)}, "classes": found.classes, "image_size": self.image_size,
                 "channels": self.channels, "splits": {}}
        sums = torch.zeros(3, self.channels, dtype=torch.float64)  # count, sum, sum of squares per channel
        for name in SPLITS:
            index, digest = [], hashlib.sha256()
            for position in sorted(parts[name].tolist()):  # each split in the folder's order
                relative, label = files[position]
                image, raw_bytes = self._read(self.root / relative)
                source.update(f"{relative.as_posix()}\0{len(raw_bytes)}\0".encode() + raw_bytes)
                written = Path(name) / relative.with_name(relative.name + ".png")
                (out / written).parent.mkdir(parents=True, exist_ok=True)
                png, image = _png(image), _tensor(image)
                (out / written).write_bytes(png)
                index.append([written.as_posix(), label])
                digest.update(f"{written.as_posix()}\0{label}\0".encode() + png)
                if name == "train":
                    pixels = image.flatten(1).double() / 255
                    sums += torch.stack([torch.full((self.channels,), pixels.shape[1], dtype=torch.float64),
                                         pixels.sum(1), pixels.pow(2).sum(1)])
            (out / f"{name}.json").write_text(json.dumps(index) + "\n")
            stats["splits"][name] = {"count": len(index), "sha256": digest.hexdigest()}
        count, total, squares = sums
        mean = total / count
        std = (squares / count - mean.pow(2)).clamp_min(0).sqrt()
        stats["channel_mean"] = mean.tolist()
        stats["channel_std"] = torch.where(std > 0, std, torch.ones_like(std)).tolist()
        stats["source"]["sha256"] = source.hexdigest()  # of every image's path and bytes, split by split
        (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        return f"{self.root} ({len(files)} images, {self.classes} classes)"

    def split(self, data_dir: Path, name: str) -> Samples:
        data_dir = Path(data_dir)
        index_file, described = data_dir / f"{name}.json", data_dir / "stats.json"
        for file in (described, index_file):
            if not file.is_file():
                raise DataError(f"{file}: missing; run `mnist-pipeline prepare` (or `dvc repro prepare`)")
        try:
            stats = json.loads(described.read_text())
            index = json.loads(index_file.read_text())
            mean, std = stats["channel_mean"], stats["channel_std"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{index_file} or {described}: unreadable ({type(exc).__name__}: {exc}); run "
                            "`mnist-pipeline prepare` (or `dvc repro prepare`) again") from None
        made = {key: stats.get(key) for key in ("image_size", "channels")}
        if made != {"image_size": self.image_size, "channels": self.channels} or len(stats.get("classes", ())) != \
                self.classes:
            raise DataError(f"{data_dir}: prepared as {made} with {len(stats.get('classes', ()))} classes, not these "
                            "workload.init_args; run `dvc repro prepare`")
        missing = [path for path, _ in index if not (data_dir / path).is_file()]
        if missing:
            raise DataError(f"{data_dir / missing[0]}: missing ({len(missing)} of the {name} split's images); run "
                            "`dvc checkout prepare`, or `dvc repro --force prepare`")
        dataset = ImageFiles(data_dir, index, self.channels, self.image_size)
        augment = self._augmentation() if self.augment and name == "train" else None
        return Samples(dataset, on_device=Standardise(mean, std), augment=augment)

    def _read(self, path: Path) -> tuple[torch.Tensor, bytes]:
        from PIL import Image, UnidentifiedImageError

        from PIL import ImageOps

        raw_bytes = path.read_bytes()
        try:
            with Image.open(io.BytesIO(raw_bytes)) as opened:
                if opened.mode in WIDE_MODES:  # Pillow's convert would clip them, not scale them
                    raise DataError(f"{path}: a {WIDE_MODES[opened.mode]} image (Pillow mode {opened.mode}); save it "
                                    "with 8 bits a channel (PNG or JPEG)")
                # As a viewer shows it: a phone's photo turned by its EXIF orientation.
                image = ImageOps.exif_transpose(opened).convert(_mode(self.channels))
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            reason = "no image format Pillow knows" if isinstance(exc, UnidentifiedImageError) else str(exc)
            raise DataError(f"{path}: not an image Pillow reads ({reason}); remove it, or save it as PNG or "
                            "JPEG") from None
        if image.size != (self.image_size, self.image_size):
            image = image.resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
        return image, raw_bytes

    def _augmentation(self):
        from torchvision.transforms import v2

        steps = [v2.RandomCrop(self.image_size, padding=max(1, self.image_size // 8))]
        if self.flip:
            steps.append(v2.RandomHorizontalFlip())
        return v2.Compose(steps)


# Pillow modes of more than 8 bits a channel, which prepare does not scale down.
WIDE_MODES = {"I;16": "16-bit", "I;16B": "16-bit", "I;16L": "16-bit", "I;16N": "16-bit", "I": "32-bit integer",
              "F": "32-bit float"}


def _ImageFolder(root: str, allow_empty: bool):
    """torchvision's ImageFolder, but a hidden folder (.ipynb_checkpoints, .git) is no class."""
    from torchvision.datasets import ImageFolder

    class Visible(ImageFolder):
        def find_classes(self, directory):
            classes = sorted(entry.name for entry in os.scandir(directory)
                             if entry.is_dir() and not entry.name.startswith("."))
            if not classes:
                raise FileNotFoundError(f"no class folder in {directory} (root/<class>/<image>)")
            return classes, {name: i for i, name in enumerate(classes)}

    return Visible(root, allow_empty=allow_empty)


def _mode(channels: int) -> str:
    return "L" if channels == 1 else "RGB"


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _tensor(image) -> torch.Tensor:
    """A Pillow image as uint8 [C, H, W]."""
    from torchvision.transforms.v2.functional import pil_to_tensor

    return pil_to_tensor(image)


class ImageFiles(torch.utils.data.Dataset):
    """A prepared split: its PNGs, decoded as they are read, each (uint8 [C, H, W], class index)."""

    def __init__(self, data_dir: Path, index: list, channels: int, image_size: int):
        self.data_dir, self.index, self.channels, self.image_size = Path(data_dir), index, channels, image_size

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        path, label = self.index[i]
        with Image.open(self.data_dir / path) as opened:
            image = _tensor(opened.convert(_mode(self.channels)))
        if tuple(image.shape) != (self.channels, self.image_size, self.image_size):
            raise DataError(f"{self.data_dir / path}: {tuple(image.shape)}, not what prepare wrote; run "
                            "`dvc repro --force prepare`")
        return image, torch.tensor(label)


class Standardise:
    """uint8 [N, C, H, W] to float32 scaled to [0, 1], then standardised per channel: element by
    element, so an image gets the same bits in any batch."""

    def __init__(self, mean: list[float], std: list[float]):
        self.mean, self.std = mean, std

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean, dtype=torch.float32, device=images.device).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=images.device).view(-1, 1, 1)
        return images.float().div_(255).sub_(mean).div_(std)


def _norm(kind: str, channels: int) -> nn.Module:
    return nn.GroupNorm(math.gcd(8, channels), channels) if kind == "group" else nn.BatchNorm2d(channels)


class Block(nn.Module):
    """A residual block: two 3x3 convolutions, a 1x1 one on the shortcut where the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.norm1 = _norm(norm, outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.norm2 = _norm(norm, outputs)
        self.shortcut = nn.Identity() if stride == 1 and inputs == outputs else nn.Sequential(
            nn.Conv2d(inputs, outputs, 1, stride, bias=False), _norm(norm, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A stem, three residual stages (width, 2x, 4x; the last two halve the image), average pooling
    and a linear layer to the classes."""

    def __init__(self, channels: int, classes: int, width: int = 16, norm: str = "group"):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False), _norm(norm, width), nn.ReLU())
        self.stages = nn.Sequential(Block(width, width, 1, norm), Block(width, 2 * width, 2, norm),
                                    Block(2 * width, 4 * width, 2, norm))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1), 1))

