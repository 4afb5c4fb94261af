"""MNIST, the default workload: handwritten digits, 28x28, ten classes, and the two networks of
pipeline.model. Its parts make exactly the calls the loop made before workloads were named, so its
weights are what they were, bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.mnist import IMAGE_SIZE
from pipeline.model import MODELS
from pipeline.workloads import Workload


class Mnist(Workload):
    """`model`: small (no dropout: the modes agree exactly) or classic (PyTorch's example, with
    dropout). `label_smoothing`: cross-entropy against targets that give this much weight to the
    other classes, a per-sample change to the loss, so the modes still see the same function of the
    same batches."""

    def __init__(self, model: str = "small", label_smoothing: float = 0.1):
        if model not in MODELS:
            raise ValueError(f"model = {model!r}: allowed: one of {tuple(MODELS)}")
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"label_smoothing = {label_smoothing!r}: allowed: from 0 up to, not including, 1")
        self.model, self.label_smoothing = model, label_smoothing

    def build_model(self) -> nn.Module:
        return MODELS[self.model]()

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets, label_smoothing=self.label_smoothing, reduction="sum")

    def eval_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Without smoothing: the loss as people compare it across recipes.
        return F.cross_entropy(outputs.float(), targets, reduction="sum")

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"accuracy": (outputs.argmax(1) == targets).sum()}

    def example_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, 1, *IMAGE_SIZE), torch.tensor([0, 1])
