"""evaluate: each mode's models/<mode>/model.pt + the test split -> results/eval/<mode>.json and
plots/confusion/<mode>.png.

Every mode in one process: a process pays about 6 s for importing torch and MLflow on the 2-core
machine we measure on, and evaluating a model takes about 2 (benchmarks/pipeline_overhead.py)."""

from pathlib import Path

import click
import torch

from pipeline.atomic import atomic_path, write_json
from pipeline.checkpoint import MODEL_FILE
from pipeline.config import MODES, Config, load_config, parse_gate
from pipeline.errors import ConfigError, PipelineError
from pipeline.evaluation import (Evaluation, TrainedModel, evaluate_model, evaluation_png, is_classifier,
                                 load_trained_model)
from pipeline.workloads import score_names
from pipeline.batches import split_of
from pipeline.parallel import Rank, pick_device
from pipeline.precision import float32_means_float32
from pipeline.tracking.after_training import log_to_mode_run
from pipeline.tracking.store import check_store, tracking_uri
from stages import slurm
from stages.common import model_dir, params_option, read_run_ids

RESULTS_DIR = Path("results/eval")
CONFUSION_DIR = Path("plots/confusion")
SLURM_LOG_DIR = Path("logs/evaluate")  # the job's output, with train.launcher: slurm
# Each training's files outside models/<mode>: a mode dropped from train.modes leaves none of them
# behind, or `dvc metrics show` and `dvc plots show` would list it next to today's modes. Its model
# and checkpoint stay in models/<mode> (and its numbers in git and MLflow).
TRAINING_RESULTS = ("results/train/{mode}.json", "results/breakdown/{mode}.json", "plots/train/{mode}.csv",
                    "plots/steps/{mode}.csv")


def evaluate_mode(config: Config, mode: str, trained: TrainedModel, data_dir: Path) -> Evaluation:
    """One mode's model on the test split: its files written, its numbers in its MLflow run."""
    device = pick_device(Rank(), config.train.device)
    # Read as train.loader has the training read its splits (the same batches, the same numbers).
    images = split_of(trained.workload.split(data_dir, "test"), device, config.train.loader,
                      config.train.loader_workers)
    result = evaluate_model(trained.module.to(device), images, config.evaluate.batch_size, device, trained.workload)
    images.close()

    png = CONFUSION_DIR / f"{mode}.png"  # a classifier's confusion matrix, else outputs against targets
    with atomic_path(png) as tmp:
        evaluation_png(result, f"{mode}: {headline(result)}", tmp)
    write_json(RESULTS_DIR / f"{mode}.json", result.summary())

    per_class = {f"test_accuracy_class_{c}": acc for c, acc in enumerate(result.per_class_accuracy or ())}
    metrics = {**{f"test_{name}": value for name, value in result.scores().items()}, **per_class}
    log_to_mode_run(config.tracking, read_run_ids(mode), metrics, [png], "evaluation",
                    datasets=(data_dir, ("test",)))
    click.echo(f"{mode}: {headline(result)}, loss {result.loss:.4f} on {result.count} "
               f"{'images' if result.accuracy is not None else 'samples'}")
    return result


def headline(result: Evaluation) -> str:
    """"test accuracy 99.06%" for a classifier; else its workload's metrics."""
    if result.accuracy is not None:
        return f"test accuracy {result.accuracy:.2%}"
    return "test " + ", ".join(f"{name} {value:.4g}" for name, value in result.metrics.items()) \
        if result.metrics else "test"


def check_gate(config: Config, trained: dict[str, TrainedModel]) -> None:
    """evaluate.gate names a score every model's workload gives: said before anything is written."""
    gate = parse_gate(config.evaluate.gate)
    if gate is None:
        return
    for mode, model in trained.items():
        names = {"loss", *score_names(model.workload, model.module, torch.device("cpu"))}
        inputs, targets = model.workload.example_batch()
        with torch.no_grad():
            if is_classifier(model.module.eval()(inputs), targets):
                names.add("accuracy")
        if gate[0] not in names:
            raise ConfigError(f"params.yaml: evaluate.gate = {config.evaluate.gate!r}: {mode}'s workload scores "
                              f"{', '.join(sorted(names))} on the test set, not {gate[0]}; name one of them")


def failures(config: Config, results: dict[str, Evaluation]) -> list[str]:
    """Each mode's test scores on the wrong side of a gate: min_test_accuracy where there is an
    accuracy (a classifier's), and evaluate.gate."""
    failed = []
    accuracy = config.evaluate.min_test_accuracy
    gate = parse_gate(config.evaluate.gate)
    for mode, result in results.items():
        if result.accuracy is not None and result.accuracy < accuracy:
            failed.append(f"{mode}: test accuracy {result.accuracy:.2%} is below evaluate.min_test_accuracy = "
                          f"{accuracy:.2%}")
        if gate is not None:
            name, op, bound = gate
            value = result.scores()[name]
            if not (value >= bound if op == ">=" else value <= bound):
                failed.append(f"{mode}: test {name} {value:.6g} fails evaluate.gate = {config.evaluate.gate!r}")
    return failed


@click.command(short_help="Test each mode's model on the test split (MNIST's 10,000 images).")
@params_option
@click.option("--mode", "modes", type=click.Choice(MODES), multiple=True,
              help="A mode to evaluate (repeatable); default: every mode in train.modes.")
@click.option("--data-dir", default="data/prepared", show_default=True, type=click.Path(file_okay=False))
def evaluate(params_path: str, modes: tuple[str, ...], data_dir: str) -> None:
    """Evaluate each mode's model on the workload's test split (MNIST's: 10,000 images) and log the
    result to its MLflow run."""
    config = load_config(params_path)
    modes = tuple(dict.fromkeys(modes)) or config.train.modes  # each once, in the order given
    # Every model first: a missing or damaged one fails the stage before anything is written.
    trained = {mode: load_trained_model(model_dir(mode) / MODEL_FILE, allow=config.workload.class_path)
               for mode in modes}
    check_gate(config, trained)
    if config.tracking.enabled:
        check_store(tracking_uri())
    if slurm.launcher(config) == "slurm":  # on a node like the ones that trained
        command = ["evaluate", "--params", params_path, "--data-dir", data_dir]
        slurm.submit(config, command + [arg for mode in modes for arg in ("--mode", mode)], SLURM_LOG_DIR,
                     slurm.job_for(config, "evaluate"))
        return
    float32_means_float32()  # the test numbers in plain float32, whatever precision trained the model
    results = {mode: evaluate_mode(config, mode, trained[mode], Path(data_dir)) for mode in modes}

    failed = failures(config, results)
    if failed:
        # The numbers stay where a person looks (the files above, the MLflow runs); DVC records
        # none of them, since the stage fails.
        bad = [mode for mode in results if any(line.startswith(f"{mode}:") for line in failed)]
        raise PipelineError(
            "; ".join(failed) + f": {'the model is' if len(bad) == 1 else 'the models are'} broken or undertrained (see "
            + ", ".join(f"results/train/{mode}.json and {model_dir(mode) / 'logs'}" for mode in bad)
            + "); fix the training params, or change the gate in params.yaml")
    if set(modes) == set(config.train.modes):  # only once every listed mode passed the gate
        drop_unlisted_modes(config.train.modes)


def drop_unlisted_modes(listed: tuple[str, ...]) -> None:
    for mode in MODES:
        if mode not in listed:
            for pattern in TRAINING_RESULTS:
                Path(pattern.format(mode=mode)).unlink(missing_ok=True)
