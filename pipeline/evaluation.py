"""Test-set evaluation of a trained model: its workload's loss and metrics, and for a classifier
(MNIST's) accuracy, per-class accuracy and the confusion matrix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.errors import PipelineError
from pipeline.plotting import pyplot
from pipeline.workloads import Workload, default_workload, saved_workload


@dataclass(frozen=True)
class TrainedModel:
    module: nn.Module
    workload: Workload  # what built it: its data, and its loss, are the ones evaluated


@dataclass(frozen=True)
class Evaluation:
    loss: float
    count: int
    metrics: dict[str, float]  # the workload's, each its sum over the test set divided by the count
    # A classifier's (outputs [N, classes], targets class indices); None for other workloads.
    accuracy: float | None = None
    per_class_accuracy: list[float] | None = None
    confusion: torch.Tensor | None = None  # [actual, predicted] counts
    predictions: torch.Tensor | None = None  # int64 [N]
    sample: tuple[torch.Tensor, torch.Tensor] | None = None  # other workloads': some (outputs, targets), to plot

    def scores(self) -> dict[str, float]:
        """Every named test score: the workload's metrics, and a classifier's accuracy."""
        return {**self.metrics, **({"accuracy": self.accuracy} if self.accuracy is not None else {}), "loss": self.loss}

    def summary(self) -> dict:
        if self.accuracy is None:
            return {**self.metrics, "loss": self.loss, "count": self.count}
        return {
            "accuracy": self.accuracy,
            "loss": self.loss,
            "per_class_accuracy": {str(c): acc for c, acc in enumerate(self.per_class_accuracy)},
            "count": self.count,
            **{name: value for name, value in self.metrics.items() if name != "accuracy"},
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
        trained = TrainedModel(module, workload)
    except PipelineError:
        raise
    except Exception as exc:
        raise PipelineError(f"{path}: not a usable model file ({exc}); train this mode again") from None
    try:
        with torch.no_grad():
            module.eval()(workload.example_batch()[0])
    except Exception as exc:
        raise PipelineError(f"{path}: its model failed on its workload's example batch ({type(exc).__name__}: "
                            f"{exc}); train this mode again") from None
    return trained


def is_classifier(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Scores per class for one class index per sample: MNIST's shape of things."""
    return (outputs.dim() == 2 and outputs.shape[1] >= 2 and targets.dim() == 1 and not targets.is_floating_point()
            and bool(((targets >= 0) & (targets < outputs.shape[1])).all()))


PLOTTED = 2000  # samples of a workload that is not a classifier, in its outputs-against-targets plot


@torch.no_grad()
def evaluate_model(module: nn.Module, data, batch_size: int, device: torch.device | None = None,
                   workload: Workload | None = None) -> Evaluation:
    """`data`: a loop.DeviceSplit, or a batches.Loaded that reads the same batches from disk; `device`:
    the model's (by default the in-memory data's); `workload`: whose evaluation loss and metrics (by
    default MNIST's). A classifier gets accuracy, per class, and the confusion matrix besides."""
    workload = workload or default_workload()
    module.eval()
    predictions, labels_seen, plotted = [], [], []
    loss = torch.zeros((), dtype=torch.float64, device=device or data.index_device)
    sums: dict[str, torch.Tensor] = {}
    classifier, classes = None, 0
    for inputs, targets in data.feed(torch.arange(len(data), device=data.index_device).split(batch_size)):
        outputs = module(inputs).float()
        loss += workload.eval_loss(outputs, targets)
        for name, value in workload.metrics(outputs, targets).items():
            sums[name] = sums.get(name, 0) + value.double()
        # A classifier while every batch is one (a negative target, an ignored index, is not a class).
        classifier = classifier is not False and is_classifier(outputs, targets)
        classes = outputs.shape[-1]
        if classifier:
            predictions.append(outputs.argmax(1))
        if sum(len(o) for o, _ in plotted) < PLOTTED:  # for the plot, should it not be a classifier
            plotted.append((outputs.cpu(), targets.cpu()))
        labels_seen.append(targets)
    actual = torch.cat(labels_seen).cpu()
    count = len(actual)
    metrics = {name: value.item() / count for name, value in sorted(sums.items())}
    if not classifier:
        sample = tuple(torch.cat(part)[:PLOTTED] for part in zip(*plotted)) if plotted else None
        return Evaluation(loss=loss.item() / count, count=count, metrics=metrics, sample=sample)
    predicted = torch.cat(predictions).cpu()
    confusion = torch.bincount(actual * classes + predicted, minlength=classes**2).reshape(classes, -1)
    per_class = (confusion.diag().double() / confusion.sum(1).clamp(min=1)).tolist()
    return Evaluation(
        loss=loss.item() / count,
        count=int(confusion.sum()),
        metrics=metrics,
        accuracy=(predicted == actual).double().mean().item(),
        per_class_accuracy=per_class,
        confusion=confusion,
        predictions=predicted,
    )


def evaluation_png(result: Evaluation, title: str, path: Path) -> None:
    """A classifier's confusion matrix; for another workload, its outputs against its targets."""
    if result.confusion is not None:
        confusion_png(result.confusion, title, path)
        return
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 5.5))
    if result.sample is not None and result.sample[0].numel() == result.sample[1].numel():  # one output a target
        outputs, targets = result.sample
        axes.scatter(targets.double().flatten().numpy(), outputs.double().flatten().numpy(), s=4, alpha=0.5)
    axes.set(xlabel="target", ylabel="output", title=title)
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")
    plt.close(figure)


def confusion_png(confusion: torch.Tensor, title: str, path: Path) -> None:
    plt = pyplot()
    classes = len(confusion)
    figure, axes = plt.subplots(figsize=(6, 5.5))
    image = axes.imshow(confusion.numpy(), cmap="Blues")
    for (actual, predicted), count in zip(torch.cartesian_prod(torch.arange(classes), torch.arange(classes)).tolist(),
                                          confusion.flatten().tolist()):
        color = "white" if count > confusion.max().item() / 2 else "black"
        axes.text(predicted, actual, str(count), ha="center", va="center", fontsize=7, color=color)
    axes.set(xticks=range(classes), yticks=range(classes), xlabel="predicted", ylabel="actual", title=title)
    figure.colorbar(image)
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")
    plt.close(figure)
