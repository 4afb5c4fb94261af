"""evaluate: models/<mode>/model.pt + the test split -> metrics/eval/<mode>.json, plots/eval/<mode>/
(one actual,predicted row per test image) and plots/confusion/<mode>.png."""

import csv
import io
from pathlib import Path

import click
import torch

from pipeline import tracking
from pipeline.atomic import atomic_path, write_json, write_text
from pipeline.checkpoint import MODEL_FILE
from pipeline.config import MODES, load_config
from pipeline.errors import PipelineError
from pipeline.evaluation import confusion_png, evaluate_model, load_trained_model
from pipeline.loop import to_device
from pipeline.prepared import load_split
from stages.common import model_dir, params_option, read_run_ids


def predictions_csv(actual: torch.Tensor, predicted: torch.Tensor) -> str:
    """One row per test image, the form DVC's confusion template reads."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["actual", "predicted"])
    writer.writerows(zip(actual.tolist(), predicted.tolist()))
    return out.getvalue()


@click.command()
@params_option
@click.option("--mode", type=click.Choice(MODES), required=True)
@click.option("--data-dir", default="data/prepared", show_default=True, type=click.Path(file_okay=False))
def evaluate(params_path: str, mode: str, data_dir: str) -> None:
    """Evaluate one mode's model on the 10,000 test images and log the result to its MLflow run."""
    config = load_config(params_path)
    if config.tracking.enabled:
        tracking.check_store(tracking.tracking_uri())
    trained = load_trained_model(model_dir(mode) / MODEL_FILE)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    test = to_device(load_split(Path(data_dir), "test"), trained.mean, trained.std, device)
    result = evaluate_model(trained.module.to(device), test, config.evaluate.batch_size)

    plots = Path("plots/eval") / mode
    write_json(Path("metrics/eval") / f"{mode}.json", result.summary())
    write_text(plots / "confusion.csv", predictions_csv(test.labels.cpu(), result.predictions))
    png = Path("plots/confusion") / f"{mode}.png"
    with atomic_path(png) as tmp:
        confusion_png(result.confusion, f"{mode}: test accuracy {result.accuracy:.2%}", tmp)

    per_class = {f"test_accuracy_class_{c}": acc for c, acc in enumerate(result.per_class_accuracy)}
    metrics = {"test_accuracy": result.accuracy, "test_loss": result.loss, **per_class}
    tracking.log_to_mode_run(config.tracking, read_run_ids(mode), metrics, [png], "evaluation",
                             datasets=(Path(data_dir), ("test",)))
    click.echo(f"{mode}: test accuracy {result.accuracy:.2%}, loss {result.loss:.4f} on {len(test)} images")
    gate = config.evaluate.min_test_accuracy
    if result.accuracy < gate:
        # The numbers stay where a person looks (the files above, the MLflow run); DVC records
        # none of them, since the stage fails.
        raise PipelineError(
            f"{mode}: test accuracy {result.accuracy:.2%} is below evaluate.min_test_accuracy = {gate:.2%}: "
            f"the model is broken or undertrained (see metrics/train/{mode}.json and "
            f"{model_dir(mode)}/logs); fix the training params, or lower the gate in params.yaml")
