"""train: data/prepared -> models/<mode>/, metrics/train/<mode>.json, plots/train/<mode>.csv."""

from __future__ import annotations

import csv
import io
import logging
import sys
from contextlib import nullcontext
from pathlib import Path

import click

from pipeline import parallel
from pipeline.atomic import save_torch, write_json, write_text
from pipeline.checkpoint import CHECKPOINT_FILE, MODEL_FILE
from pipeline.config import MODES, Config, flatten, load_config
from pipeline.loop import Training, to_device, train as train_model
from pipeline.prepared import load_prepared, load_stats
from stages.common import params_option

log = logging.getLogger(__name__)
CURVE_COLUMNS = ("epoch", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "samples_per_s", "epoch_time_s")


def model_dir(mode: str) -> Path:
    return Path("models") / mode


def summarize(config: Config, mode: str, rank: parallel.Rank, device, history: list[dict]) -> dict:
    last = history[-1]
    train_time = sum(m["train_time_s"] for m in history)
    samples = sum(m["samples_per_s"] * m["train_time_s"] for m in history)
    return {
        "mode": mode,
        "world_size": rank.world_size,
        "backend": parallel.backend_for(device) if mode == "ddp" else None,
        "device": device.type,
        "device_name": parallel.device_name(device),
        # DataParallel splits each batch over this many devices; 1 on a CPU-only host (bare module).
        "dp_devices": parallel.dp_device_count(device) if mode == "dp" else None,
        "epochs": len(history),
        "batch_size": config.train.batch_size,
        "per_rank_batch_size": config.train.batch_size // rank.world_size,
        "train_time_s": round(train_time, 3),
        "samples_per_s": round(samples / train_time, 1),
        **{key: last[key] for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy")},
    }


def curves_csv(history: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CURVE_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(history)
    return out.getvalue()


def run_worker(config: Config, mode: str, data_dir: Path, resume: bool) -> None:
    """Train in this process: the whole job for single and dp, one rank's share for ddp."""
    rank = parallel.rank_from_env()
    if not rank.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # other ranks speak only when something fails
    device = parallel.pick_device(rank)
    if mode == "ddp" and device.type == "cpu":
        parallel.limit_cpu_threads(rank)
    out = model_dir(mode)
    resume = resume or (parallel.restarted_by_torchrun() and (out / CHECKPOINT_FILE).is_file())

    with parallel.process_group(rank, device) if mode == "ddp" else nullcontext():
        data = load_prepared(data_dir, ("train", "val"))
        channels_last = device.type == "cuda" and config.train.channels_last
        train_split = to_device(data.splits["train"], data.mean, data.std, device, channels_last)
        val_split = to_device(data.splits["val"], data.mean, data.std, device, channels_last)
        log.info("%s: %d process(es) on %s, global batch %d", mode, rank.world_size,
                 parallel.device_name(device), config.train.batch_size)
        run = Training(config.train, mode, rank, device, out, resume=resume)
        model, history = train_model(run, train_split, val_split)
        if rank.is_main:
            save_torch(out / MODEL_FILE, {
                "state_dict": model.state_dict(),
                "model": config.train.model,
                "normalization": {"mean": data.mean, "std": data.std},
                "config": flatten(config),
            })
            write_json(Path("metrics/train") / f"{mode}.json", summarize(config, mode, rank, device, history))
            write_text(Path("plots/train") / f"{mode}.csv", curves_csv(history))


@click.command()
@params_option
@click.option("--mode", type=click.Choice(MODES), required=True, help="single, dp (DataParallel) or ddp.")
@click.option("--data-dir", default="data/prepared", show_default=True, type=click.Path(file_okay=False))
@click.option("--resume", is_flag=True, help="Continue from models/<mode>/checkpoint.pt.")
def train(params_path: str, mode: str, data_dir: str, resume: bool) -> None:
    """Train one mode. For ddp, starts one worker per device unless already under torchrun."""
    config = load_config(params_path)
    if mode == "ddp" and not parallel.under_torchrun():
        nproc = config.train.nproc or parallel.default_nproc()
        # Fail here, before any worker starts, on what would fail in every worker.
        parallel.per_rank_batch(config.train.batch_size, nproc)
        load_stats(Path(data_dir))
        argv = [sys.executable, "-m", "pipeline", "train", "--mode", "ddp",
                "--params", params_path, "--data-dir", data_dir] + (["--resume"] if resume else [])
        click.echo(f"ddp: launching {nproc} workers")
        parallel.launch_workers(nproc, argv)
        return
    run_worker(config, mode, Path(data_dir), resume)
