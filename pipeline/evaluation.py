"""Test-set evaluation of a trained model: accuracy, loss, per-class accuracy, confusion matrix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.errors import PipelineError
from pipeline.plotting import pyplot
from pipeline.prepared import NUM_CLASSES
from pipeline.workloads import Workload, default_workload, saved_workload


@dataclass(frozen=True)
class TrainedModel:
    module: nn.Module
    mean: float
    std: float
    workload: Workload  # what built it: its loss is the one evaluated


@dataclass(frozen=True)
class Evaluation:
    accuracy: float
    loss: float
    per_class_accuracy: list[float]
    confusion: torch.Tensor  # [actual, predicted] counts
    predictions: torch.Tensor  # int64 [N]

    def summary(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "loss": self.loss,
            "per_class_accuracy": {str(c): acc for c, acc in enumerate(self.per_class_accuracy)},
            "count": int(self.confusion.sum()),
        }


def load_trained_model(path: Path, allow: str | None = None) -> TrainedModel:
    """The model a train stage saved, built by the workload it names (`allow`: a class path outside
    this package that the project's params name); a missing or damaged file is an error that names it."""
    if not path.is_file():
        raise PipelineError(f"{path}: missing; train this mode first (mnist-pipeline train, or dvc repro)")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        workload = saved_workload(saved, path, allow)
        module = workload.build_model()
        module.load_state_dict(saved["state_dict"])
        norm = saved["normalization"]
        trained = TrainedModel(module, float(norm["mean"]), float(norm["std"]), workload)
    except PipelineError:
        raise
    except Exception as exc:
        raise PipelineError(f"{path}: not a usable model file ({exc}); train this mode again") from None
    try:
        with torch.no_grad():
            shape = tuple(module.eval()(workload.example_batch()[0]).shape)
    except Exception as exc:
        raise PipelineError(f"{path}: its model failed on its workload's example batch ({type(exc).__name__}: "
                            f"{exc}); train this mode again") from None
    if len(shape) != 2 or shape[1] != NUM_CLASSES:
        raise PipelineError(f"{path}: its model's outputs have the shape {shape} on its workload's example batch; "
                            f"evaluate scores a classifier of {NUM_CLASSES} classes (accuracy, per class, the "
                            "confusion matrix), and other workloads' test metrics are not there yet (#53)")
    return trained


@torch.no_grad()
def evaluate_model(module: nn.Module, data, batch_size: int, device: torch.device | None = None,
                   workload: Workload | None = None) -> Evaluation:
    """`data`: a loop.DeviceSplit, or a batches.Loaded that reads the same batches from disk; `device`:
    the model's (by default the in-memory data's); `workload`: whose evaluation loss (by default
    MNIST's cross-entropy). The scores are a classifier's: accuracy, per class, the confusion matrix."""
    workload = workload or default_workload()
    module.eval()
    predictions, labels_seen = [], []
    loss = torch.zeros((), dtype=torch.float64, device=device or data.index_device)
    for images, labels in data.feed(torch.arange(len(data), device=data.index_device).split(batch_size)):
        logits = module(images).float()
        loss += workload.eval_loss(logits, labels)
        predictions.append(logits.argmax(1))
        labels_seen.append(labels)
    predicted = torch.cat(predictions).cpu()
    actual = torch.cat(labels_seen).cpu()
    confusion = torch.bincount(actual * NUM_CLASSES + predicted, minlength=NUM_CLASSES**2).reshape(NUM_CLASSES, -1)
    per_class = (confusion.diag().double() / confusion.sum(1).clamp(min=1)).tolist()
    return Evaluation(
        accuracy=(predicted == actual).double().mean().item(),
        loss=loss.item() / len(actual),
        per_class_accuracy=per_class,
        confusion=confusion,
        predictions=predicted,
    )


def confusion_png(confusion: torch.Tensor, title: str, path: Path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 5.5))
    image = axes.imshow(confusion.numpy(), cmap="Blues")
    for (actual, predicted), count in zip(torch.cartesian_prod(torch.arange(10), torch.arange(10)).tolist(),
                                          confusion.flatten().tolist()):
        color = "white" if count > confusion.max().item() / 2 else "black"
        axes.text(predicted, actual, str(count), ha="center", va="center", fontsize=7, color=color)
    axes.set(xticks=range(10), yticks=range(10), xlabel="predicted", ylabel="actual", title=title)
    figure.colorbar(image)
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")
    plt.close(figure)
