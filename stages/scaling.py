"""scaling: ddp (and fsdp) trained at several world sizes on this host, one training each, and the
curves of speed-up and efficiency against ranks beside the scaling model's (not a DVC stage: `make
scaling`).

Each training runs in scaling/runs/<mode>-<N>/ (its own models/, results/ and log), from the
workspace's prepared data and params.yaml with train.modes [<mode>] and train.nproc N, MLflow off:
the `scaling` run holds the curve, so the mode runs of the sweep do not crowd the runs page. The
report (scaling.md, curve.png, scaling.json) goes to scaling/report/, whole or not at all."""

import json
import subprocess
import sys
from pathlib import Path

import click
import yaml

from pipeline import scaling_curve
from pipeline.scaling import Link, measured_link
from pipeline.atomic import atomic_dir, check_replaceable, read_json, write_text
from pipeline.config import DISTRIBUTED, load_config
from pipeline.errors import PipelineError
from pipeline.report import interval_text
from pipeline.tracking.after_training import log_scaling_run
from pipeline.tracking.store import check_store, tracking_uri
from stages.common import params_option
from stages.slurm import last_words

REPORT_FILES = ("scaling.md", "curve.png", "scaling.json")


def default_world_sizes() -> list[int]:
    """1 to the GPUs there are; on a CPU, 1 to twice the cores, so the curve shows what ranks past
    the cores do (powers of two past 8)."""
    import torch

    from pipeline.parallel import available_cpus

    top = gpu_count() if torch.cuda.is_available() else 2 * available_cpus()
    return list(range(1, top + 1)) if top <= 8 else [2 ** i for i in range(top.bit_length()) if 2 ** i <= top]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def parse_sizes(_ctx, _param, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        sizes = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r}: give world sizes as numbers, e.g. 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise click.BadParameter(f"{value!r}: world sizes are 1 or more, e.g. 1,2,4")
    return sizes


def commcheck_link(path: Path, device: str) -> Link | None:
    """The link results/comm.json measured, if it passed on this kind of device."""
    try:
        facts = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not facts.get("passed") or facts.get("device") != device:
        return None
    return measured_link({"world_size": facts.get("world_size"), "backend": facts.get("backend"),
                                  "sweep": [r for r in facts.get("sweep", []) if r["primitive"] == "all_reduce"]})


def parse_modes(_ctx, _param, value: str | None) -> list[str] | None:
    """The modes a curve is drawn for: those with ranks (single and dp have none)."""
    if value is None:
        return None
    modes = list(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    if not modes or not set(modes) <= set(DISTRIBUTED):
        raise click.BadParameter(f"{value!r}: give modes from {', '.join(DISTRIBUTED)}, e.g. ddp,fsdp")
    return modes


def default_modes(train_modes) -> list[str]:
    """ddp, and fsdp too where train.modes trains it."""
    return ["ddp"] + (["fsdp"] if "fsdp" in train_modes else [])


def train_at(mode: str, ranks: int, params: dict, data_dir: Path, folder: Path) -> dict:
    """`mode` on `ranks` ranks in `folder`: its breakdown, with the host's load during it."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = {**params, "train": {**params["train"], "modes": [mode], "nproc": ranks, "launcher": "local"},
                "tracking": {**params.get("tracking", {}), "enabled": False}}
    write_text(folder / "params.yaml", yaml.safe_dump(settings, sort_keys=False))
    log = folder / "train.log"
    click.echo(f"scaling: {mode} on {ranks} rank(s), training (log: {log})")
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-m", "stages", "train", "--mode", mode, "--params", "params.yaml",
                               "--data-dir", str(data_dir.resolve())], cwd=folder, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise PipelineError(f"scaling: {mode} on {ranks} rank(s) failed (exit {code}): {last_words(log)}; "
                            f"its log: {log}")
    breakdown = read_json(folder / f"results/breakdown/{mode}.json", "run make scaling again")
    train = read_json(folder / f"results/train/{mode}.json", "run make scaling again")
    return {**breakdown, "host_load": train.get("host_load"), "cpu_cores": train.get("cpu_cores")}


def check_measurable(config, data_dir: Path, params_path: str) -> None:
    """Before any training: an epoch of the same global batch has the same steps at every world
    size, so one that the traced steps take whole leaves no step to measure at any of them."""
    from pipeline.loop import steps_per_epoch
    from pipeline.prepared import load_stats

    images = load_stats(data_dir)["splits"]["train"]["count"]
    steps = steps_per_epoch(images, config.train.batch_size)
    if steps <= config.train.trace_steps:
        raise PipelineError(f"{params_path}: an epoch of {images} images in global batches of "
                            f"{config.train.batch_size} has {steps} step(s), all of them traced (train.trace_steps: "
                            f"{config.train.trace_steps}): no world size would measure a step; lower "
                            "train.batch_size or train.trace_steps, or prepare more data (data.train_limit)")


@click.command(short_help="ddp (and fsdp) at several world sizes: the scaling curves (make scaling).")
@params_option
@click.option("--world-sizes", callback=parse_sizes, help="Comma-separated ranks, e.g. 1,2,4 (default: 1 to the "
              "GPUs; on a CPU, 1 to twice the cores).")
@click.option("--modes", callback=parse_modes, help="Comma-separated modes, a curve each: ddp, fsdp (default: ddp, "
              "and fsdp where train.modes has it).")
@click.option("--data-dir", default="data/prepared", show_default=True, type=click.Path(file_okay=False))
@click.option("--out", default="scaling", show_default=True, type=click.Path(file_okay=False))
def scaling(params_path: str, world_sizes: list[int] | None, modes: list[str] | None, data_dir: str,
            out: str) -> None:
    """Train each mode (ddp, and fsdp) once per world size on this host and draw speed-up and
    efficiency against ranks, measured with 95% intervals, beside the scaling model's prediction:
    scaling/report/ and an MLflow run named `scaling`."""
    config = load_config(params_path)
    if not config.train.breakdown_steps:
        raise PipelineError(f"{params_path}: train.breakdown_steps is 0: the curve is made of measured steps; "
                            "set it to 20 (the default)")
    if not (Path(data_dir) / "train.pt").is_file():
        raise PipelineError(f"{data_dir}: no prepared data; run `dvc repro prepare` (make scaling does) first")
    check_measurable(config, Path(data_dir), params_path)
    if config.tracking.enabled:
        check_store(tracking_uri())
    report = Path(out) / "report"
    check_replaceable(report, REPORT_FILES)  # before the trainings, not after them
    params = yaml.safe_load(Path(params_path).read_text())
    sizes = world_sizes or default_world_sizes()
    runs = {mode: {ranks: train_at(mode, ranks, params, Path(data_dir), Path(out) / "runs" / f"{mode}-{ranks}")
                   for ranks in sizes}
            for mode in modes or default_modes(config.train.modes)}
    first = next(iter(runs.values()))[min(sizes)]
    cores = first.get("cpu_cores") or 1
    devices = gpu_count() if first["device"] == "cuda" else 0
    link = commcheck_link(Path("results/comm.json"), first["device"])
    rows = [row for each in runs.values() for row in scaling_curve.curve(each, link, cores, devices)]
    with atomic_dir(report, REPORT_FILES) as tmp:
        (tmp / "scaling.md").write_text(scaling_curve.markdown(rows, cores, link))
        (tmp / "scaling.json").write_text(json.dumps(scaling_curve.as_json(rows, cores, link), indent=2) + "\n")
        scaling_curve.png(rows, tmp / "curve.png", cores)
    run_id = log_scaling_run(config.tracking, scaling_curve.summary(rows), [report / name for name in REPORT_FILES])
    for row in rows:
        click.echo(f"scaling: {row['mode']} on {row['ranks']} rank(s): step "
                   f"{interval_text(row['step'], '.2f', ' ms', 1000)}, "
                   f"speed-up {interval_text(row['speedup'], '.2f', 'x')}"
                   + (f", model {row['predicted_speedup']:.2f}x" if row["predicted_speedup"] else "")
                   + (" [oversubscribed]" if row["oversubscribed"] else ""))
        for warning in row["warnings"]:
            click.echo(f"scaling: warning: {warning}", err=True)
    click.echo(f"scaling: the curves in {report / 'curve.png'}, the table in {report / 'scaling.md'}"
               + (f"; MLflow run {run_id} (named scaling)" if run_id else ""))
