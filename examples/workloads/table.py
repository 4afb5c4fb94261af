"""A team's own workload, not image classification: regression on a table (a CSV file), with its
own data. Copy this file into the project's `workloads/` folder and name it in params.yaml:

    workload:
      class_path: workloads.table.Regression
      init_args: {source: data/table.csv, features: [x1, x2, x3], target: y}
    evaluate:
      gate: "abs_error <= 0.5"

and, in dvc.yaml, give the prepare stage the table and these init_args, so that an edited table is
prepared again (docs/workloads.md, "Your own data"):

      prepare:
        deps: [<the deps already listed>, data/table.csv]
        params: [data, workload.class_path, workload.init_args]

`prepare` reads the CSV, checks it (the columns named, numbers only, the SHA-256 if `sha256` pins
it), splits its rows by a seeded permutation and standardises the features with the training rows'
mean and std (kept in stats.json: the model takes standardised inputs); `train`, `evaluate` and
`compare` then run as they do for MNIST.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from pipeline.config import DataConfig
from pipeline.errors import DataError
from pipeline.workloads import Samples, Workload

SPLITS = ("train", "val", "test")


class Regression(Workload):
    """An MLP from the `features` columns to the `target` column, trained on the squared error.
    `val_fraction` and `test_fraction` of the rows go to validation and test (data.seed draws which)."""

    def __init__(self, source: str, features: list[str], target: str, hidden: int = 32,
                 val_fraction: float = 0.15, test_fraction: float = 0.15, sha256: str = ""):
        if not features or len(set(features)) != len(features) or target in features:
            raise ValueError(f"features = {features!r}: name each input column once, and not the target")
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError("val_fraction and test_fraction: each above 0, together below 1")
        self.source, self.features, self.target, self.hidden = Path(source), list(features), target, hidden
        self.val_fraction, self.test_fraction, self.sha256 = val_fraction, test_fraction, sha256

    # The model and its loss: per-sample terms, summed, so single, dp and ddp agree to rounding.
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(len(self.features), self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if outputs.shape != targets.shape:  # (N, 1) against (N,) would broadcast to (N, N), silently
            raise ValueError(f"outputs {tuple(outputs.shape)} and targets {tuple(targets.shape)} differ in shape")
        return F.mse_loss(outputs, targets, reduction="sum")

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        error = outputs - targets
        return {"abs_error": error.abs().sum(), "squared_error": error.pow(2).sum()}

    def example_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Targets away from any output: every score is non-zero, so the check can tell a sum from a mean.
        return torch.zeros(2, len(self.features)), torch.tensor([[3.0], [-2.0]])

    # Its data.
    def prepare(self, out: Path, raw: Path, data: DataConfig) -> str:
        text, digest = self._read_source()
        rows = self._rows(text)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(data.seed))
        val, test = round(len(rows) * self.val_fraction), round(len(rows) * self.test_fraction)
        if min(val, test) < 1 or len(rows) - val - test < 2:  # two training rows at least: their std
            raise DataError(f"{self.source}: {len(rows)} rows leave a split empty; add rows or change "
                            "val_fraction and test_fraction")
        # Sorted: each split keeps the file's order, easy to trace back to it.
        parts = {"val": order[:val].sort().values, "test": order[val:val + test].sort().values,
                 "train": order[val + test:].sort().values}
        table = torch.tensor(rows, dtype=torch.float64)
        inputs, targets = table[:, :-1], table[:, -1:]
        mean, std = inputs[parts["train"]].mean(0), inputs[parts["train"]].std(0)
        std = torch.where(std > 0, std, torch.ones_like(std))  # a column constant in training: left as it is
        stats = {"source": {"path": str(self.source), "sha256": digest},
                 "features": self.features, "target": self.target,
                 "feature_mean": mean.tolist(), "feature_std": std.tolist(), "splits": {}}
        for name in SPLITS:
            split = {"inputs": ((inputs[parts[name]] - mean) / std).float(), "targets": targets[parts[name]].float()}
            torch.save(split, out / f"{name}.pt")
            stats["splits"][name] = {"count": len(parts[name]), "sha256": _digest(split)}
        (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        return f"{self.source} ({len(rows)} rows, {len(self.features)} features)"

    def split(self, data_dir: Path, name: str) -> Samples:
        path, described = Path(data_dir) / f"{name}.pt", Path(data_dir) / "stats.json"
        for file in (described, path):
            if not file.is_file():
                raise DataError(f"{file}: missing; run `mnist-pipeline prepare` (or `dvc repro prepare`)")
        try:
            stats = json.loads(described.read_text())
            expected = stats["splits"][name]["sha256"]
            split = torch.load(path, weights_only=True)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise DataError(f"{path} or {described}: unreadable ({type(exc).__name__}: {exc}); run `mnist-pipeline "
                            "prepare` (or `dvc repro prepare`) again") from None
        if stats.get("features") != self.features or stats.get("target") != self.target:
            raise DataError(f"{data_dir}: prepared for features {stats.get('features')} and target "
                            f"{stats.get('target')!r}, not these workload.init_args; run `dvc repro prepare`")
        if _digest(split) != expected:
            raise DataError(f"{path}: changed since `prepare` wrote it; run `dvc repro --force prepare`")
        return Samples(TensorDataset(split["inputs"], split["targets"]))

    def _read_source(self) -> tuple[str, str]:
        try:
            raw = self.source.read_bytes()
            text = raw.decode("utf-8-sig")
        except OSError as exc:
            raise DataError(f"{self.source}: {exc.strerror or exc}; set workload.init_args.source to the CSV "
                            "file, relative to the project") from None
        except UnicodeDecodeError as exc:
            raise DataError(f"{self.source}: not UTF-8 text ({exc}); save it as UTF-8") from None
        digest = hashlib.sha256(raw).hexdigest()  # the file's, as sha256sum gives it
        if self.sha256 and digest != self.sha256:
            raise DataError(f"{self.source}: its SHA-256 is {digest}, not the {self.sha256} that "
                            "workload.init_args.sha256 pins; restore the file, or pin the new one")
        return text, digest

    def _rows(self, text: str) -> list[list[float]]:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        missing = [c for c in (*self.features, self.target) if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{self.source}: no column {missing[0]!r} (its columns: {reader.fieldnames}); check "
                            "workload.init_args.features and target")
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                values = [float(row[c]) for c in (*self.features, self.target)]
            except (TypeError, ValueError):
                raise DataError(f"{self.source}, line {line}: a value that is not a number in "
                                f"{[row.get(c) for c in (*self.features, self.target)]}") from None
            if not all(math.isfinite(v) for v in values):
                raise DataError(f"{self.source}, line {line}: a value that is not finite")
            rows.append(values)
        return rows


def _digest(split: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in ("inputs", "targets"):
        tensor = split[key]
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()
