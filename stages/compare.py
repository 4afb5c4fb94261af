"""compare: every mode's training and test results -> metrics/<mode>.json (what DVC compares),
reports/comparison.md and its plots."""

from pathlib import Path

import click

from pipeline import explain, spread
from pipeline.atomic import atomic_dir, check_replaceable, read_json, write_json
from pipeline.config import MODES, load_config
from pipeline.errors import PipelineError
from pipeline.report import (ModeResult, comparison_rows, console_table, loss_png, markdown, mode_metrics, modes_csv,
                             read_curves, throughput_png, val_scores_csv, warnings)
from pipeline.tracking.after_training import log_compare_run, log_to_mode_run
from pipeline.tracking.links import compare_link, ui_link
from pipeline.tracking.store import check_store, tracking_uri
from stages.common import params_option, read_run_ids

REPORT_FILES = ("comparison.md", "throughput.png", "loss.png", "timeline.png", "scaling.json", "steps.csv", "epochs.csv",
                "val_scores.csv")
METRICS_DIR = Path("metrics")


def epoch_columns(results) -> list[str]:
    """The curves' losses and the workload's metrics (MNIST: val_loss, val_accuracy, train_loss,
    train_accuracy), as the train stage wrote them, validation first."""
    header = list(results[0].curves[0]) if results and results[0].curves else []
    return [name for split in ("val_", "train_") for name in header
            if name.startswith(split) and name != "train_time_s"]


def read_metrics(path: Path) -> dict:
    if not path.is_file():
        raise PipelineError(f"{path}: missing; run the train and evaluate stages first (dvc repro)")
    return read_json(path, "run the train and evaluate stages again (dvc repro)")


def mode_result(mode: str, breakdown: dict) -> ModeResult:
    curves, steps = Path("plots/train") / f"{mode}.csv", Path("plots/steps") / f"{mode}.csv"
    for path in (curves, steps):
        if not path.is_file():
            raise PipelineError(f"{path}: missing; run the train stage for {mode} first (dvc repro)")
    return ModeResult(mode, read_metrics(Path("results/train") / f"{mode}.json"),
                      read_metrics(Path("results/eval") / f"{mode}.json"), read_curves(curves), read_curves(steps),
                      spread.step_series(breakdown), spread.windows_of(breakdown))


def interval_figures(row: dict) -> dict[str, float]:
    """The intervals beside the figures each mode's run already has (step_s, speedup_over_single,
    scaling_efficiency), under the same names in every mode."""
    figures = {}
    for name, interval in (("step_s", row["step"]), ("speedup_over_single", row["speedup_interval"]),
                           ("scaling_efficiency", row["efficiency_interval"])):
        if interval:
            figures.update({f"{name}_low": interval.low, f"{name}_high": interval.high})
    if row["step"]:
        figures["steps_measured"] = row["steps_measured"]
    return figures


def warning_tags(row: dict) -> dict[str, str] | None:
    """A run's tags for what makes its timing suspect (MLflow's search: tags.timing_warning != '')."""
    tags = {}
    if row["impossible"]:
        tags["speedup_warning"] = row["impossible"]
    if row["disturbed"] or row.get("too_short"):
        tags["timing_warning"] = "; ".join([*([row["too_short"]] if row.get("too_short") else []), *row["disturbed"]])
    return tags or None


@click.command(short_help="Compare the modes: metrics/, reports/, MLflow.")
@params_option
@click.option("--out", default="reports", show_default=True, type=click.Path(file_okay=False))
def compare(params_path: str, out: str) -> None:
    """Write reports/comparison.md (table + plots) and log it as a `compare` MLflow run."""
    config = load_config(params_path)
    if config.tracking.enabled:
        check_store(tracking_uri())
    check_replaceable(Path(out), REPORT_FILES)
    breakdowns = {mode: read_metrics(Path("results/breakdown") / f"{mode}.json") for mode in config.train.modes}
    results = [mode_result(mode, breakdowns[mode]) for mode in config.train.modes]
    rows = comparison_rows(results)
    scaling = explain.scaling_report(breakdowns, config.compare)
    with atomic_dir(out, REPORT_FILES) as tmp:
        (tmp / "comparison.md").write_text(markdown(rows, results) + "\n" + explain.markdown(breakdowns, scaling))
        write_json(tmp / "scaling.json", scaling)
        throughput_png(rows, tmp / "throughput.png")
        loss_png(results, tmp / "loss.png")
        explain.timeline_png(breakdowns, tmp / "timeline.png")
        # Every mode's curves in one file each, for DVC's charts (dvc.yaml's plots).
        (tmp / "steps.csv").write_text(modes_csv(results, "steps", ("step", "epoch", "train_loss")))
        (tmp / "epochs.csv").write_text(modes_csv(results, "curves", ("epoch", *epoch_columns(results))))
        (tmp / "val_scores.csv").write_text(val_scores_csv(results))
    # File by file, with no marker beside them: DVC reads every file in the folder as a metric.
    for mode in MODES:
        if mode not in config.train.modes:
            (METRICS_DIR / f"{mode}.json").unlink(missing_ok=True)
    for row in rows:
        write_json(METRICS_DIR / f"{row['mode']}.json", mode_metrics(row))
    files = [Path(out) / name for name in REPORT_FILES]

    mode_ids = {r.mode: read_run_ids(r.mode) for r in results}
    # Each number goes to its own mode's run, under one name in every mode, so one MLflow chart
    # answers one question for all of them; the compare run holds the report and the links.
    for row in rows:
        summary = {"speedup_over_single": row["speedup"], "scaling_efficiency": row["scaling_efficiency"],
                   "total_train_time_s": row["train_time_s"], "mean_samples_per_s": row["samples_per_s"],
                   "steady_samples_per_s": row["steady_samples_per_s"],
                   **explain.run_figures(breakdowns[row["mode"]], scaling["predictions"][row["mode"]]),
                   **interval_figures(row)}
        log_to_mode_run(config.tracking, mode_ids[row["mode"]],
                        {key: value for key, value in summary.items() if value is not None}, [],
                        tags=warning_tags(row))
    log_compare_run(config.tracking, mode_ids, files)
    click.echo(console_table(rows))
    for row in rows:
        for warning in warnings(row):
            click.echo(f"compare: warning: {warning}", err=True)
    click.echo(f"compare: the full table and its plots in {Path(out) / 'comparison.md'}; "
               f"the numbers DVC compares in {METRICS_DIR}/ (dvc metrics show, make show)")
    tracked = [ids for ids in mode_ids.values() if ids]
    if config.tracking.enabled and tracked:
        experiment = tracked[0]["experiment_id"]
        hint = "" if tracking_uri().startswith("http") else " (after `make ui`)"
        click.echo(f"MLflow: the mode runs side by side at {ui_link(experiment)}{hint}")
        click.echo(f"MLflow: every number compared at "
                   f"{compare_link(experiment, [ids['parent'] for ids in tracked])}{hint}")
