"""The comparison report: what each parallel mode bought, as a Markdown table and two plots."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from pipeline.plotting import pyplot


@dataclass(frozen=True)
class ModeResult:
    mode: str
    train: dict  # results/train/<mode>.json
    eval: dict  # results/eval/<mode>.json
    curves: list[dict]  # plots/train/<mode>.csv rows, one per epoch
    steps: list[dict]  # plots/steps/<mode>.csv rows: the training loss per window of steps

    @property
    def devices(self) -> int:
        """How many devices the mode trained on: what a perfect speed-up would equal. On a CPU
        every mode shares the same cores, so ranks add no hardware and the ideal stays 1x."""
        if self.train["device"] == "cpu":
            # Ranks on one machine share its cores; each further machine adds its own.
            return self.train.get("nodes", 1) if self.mode == "ddp" else 1
        if self.mode == "ddp":
            return self.train["world_size"]
        if self.mode == "dp":
            return self.train["dp_devices"]
        return 1

    @property
    def speedup_bound(self) -> int | None:
        """The largest speed-up over single the hardware allows: the devices for GPUs, the usable
        cores (of every node) for CPU ranks, which also sped single's intra-op threads; None where
        an older results file does not say its cores."""
        if self.train["device"] != "cpu":
            return self.devices
        cores = self.train.get("cpu_cores")
        return cores * (self.train.get("nodes", 1) if self.mode == "ddp" else 1) if cores else None

    @property
    def bare_dp(self) -> bool:
        return self.mode == "dp" and self.train["device"] == "cpu"


def read_curves(path: Path) -> list[dict]:
    with path.open() as handle:
        return [{key: float(value) for key, value in row.items()} for row in csv.DictReader(handle)]


def steady(train: dict) -> float | None:
    """Samples/s after each epoch's warm-up steps (older metrics, or epochs too short: None)."""
    return train.get("steady_samples_per_s")


def comparison_rows(results: list[ModeResult]) -> list[dict]:
    baseline = next((r for r in results if r.mode == "single"), None)
    # Speed-ups compare steady states where every mode has one: a fast GPU's short epoch is mostly
    # warm-up (handles, algorithm choice, kernel loading), which says nothing about the mode.
    key = "steady_samples_per_s" if all(steady(r.train) for r in results) else "samples_per_s"
    rows = []
    for r in results:
        speedup = r.train[key] / baseline.train[key] if baseline else None
        rows.append({
            "mode": r.mode,
            "world_size": r.train["world_size"],
            # DDP's ranks as machines x processes on each (older metrics files lack the split).
            "layout": (f"{r.train['nodes']} × {r.train['procs_per_node']}"
                       if r.mode == "ddp" and "nodes" in r.train else None),
            # Samples of each global batch per rank (ddp) or per GPU (dp); older metrics lack it.
            "shares": r.train.get("batch_shares", "n/a"),
            "device": r.train["device_name"] + (" (bare module: no GPU to split over)" if r.bare_dp else ""),
            "epochs": r.train["epochs"],
            "samples_per_s": r.train["samples_per_s"],
            "steady_samples_per_s": steady(r.train),
            "warmup_steps": r.train.get("warmup_steps"),
            "speedup_from": key,
            "speedup": speedup,
            "scaling_efficiency": speedup / r.devices if speedup is not None else None,
            "impossible": impossible(r.mode, speedup, r.speedup_bound, r.train["device"]),
            "train_time_s": r.train["train_time_s"],
            "test_accuracy": r.eval["accuracy"],
            "test_loss": r.eval.get("loss"),  # older results lack these
            "val_accuracy": r.train.get("val_accuracy"),
            "val_loss": r.train.get("val_loss"),
        })
    return rows


def impossible(mode: str, speedup: float | None, bound: int | None, device: str) -> str | None:
    """Why `mode`'s speed-up cannot be what the hardware gave, or None: above the bound, the
    baseline (single) was slowed by something else (another job, a busy host), not `mode` sped up."""
    if speedup is None or bound is None or speedup <= bound:
        return None
    what = f"{bound} core(s)" if device == "cpu" else f"{bound} device(s)"
    return (f"{mode}'s speed-up of {speedup:.2f}x is more than its {what} allow: the single-device baseline was "
            "probably slowed by other work on the host; run the pipeline again on a quiet machine")


def modes_csv(results: list[ModeResult], curve: str, columns: tuple[str, ...]) -> str:
    """One curve of every mode (ModeResult.steps or .curves) in one table, a `mode` column first."""
    lines = [",".join(("mode", *columns))]
    for r in results:
        for row in getattr(r, curve):
            lines.append(",".join([r.mode] + [f"{int(row[c])}" if c in ("step", "epoch") else repr(row[c])
                                              for c in columns]))
    return "\n".join(lines) + "\n"


def mode_metrics(row: dict) -> dict:
    """metrics/<mode>.json: what `dvc metrics show` and `dvc exp show` compare, the test set's
    accuracy and loss first; numbers only (the mode's facts are in results/, its curves in plots/)."""
    # DVC orders the columns by name: accuracy and loss (on the test set) lead.
    keys = ("accuracy", "loss", "samples_per_s", "scaling_efficiency", "speedup", "train_time_s",
            "val_accuracy", "val_loss")
    # samples_per_s is the figure the speed-up divides: after the warm-up where every mode has one.
    values = {**row, "accuracy": row["test_accuracy"], "loss": row["test_loss"],
              "samples_per_s": row[row["speedup_from"]]}
    return {key: round(values[key], 6) if isinstance(values[key], float) else values[key]
            for key in keys if values[key] is not None}


def console_table(rows: list[dict]) -> str:
    """The comparison in a terminal's width: what `dvc repro` ends with."""
    lines = [f"{'mode':<7} {'test accuracy':>13} {'samples/s':>10} {'speed-up':>9} {'training time':>14}"]
    for r in rows:
        speedup = f"{'n/a':>9}" if r["speedup"] is None else f"{r['speedup']:>8.2f}x"
        lines.append(f"{r['mode']:<7} {r['test_accuracy']:>13.2%} {r[r['speedup_from']]:>10,.0f} {speedup} "
                     f"{r['train_time_s']:>12.1f} s")
    return "\n".join(lines)


def _fmt(value, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def markdown(rows: list[dict], results: list[ModeResult]) -> str:
    lines = [
        "# Data-parallel modes compared",
        "",
        "| mode | world size (nodes × processes) | batch per rank or GPU | device | epochs | samples/s "
        "| samples/s after warm-up | speed-up over single | scaling efficiency | training time (s) | test accuracy |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        world = f"{row['world_size']} ({row['layout']})" if row["layout"] else str(row["world_size"])
        lines.append(
            f"| {row['mode']} | {world} | {row['shares']} | {row['device']} | {row['epochs']} | "
            f"{row['samples_per_s']:,.0f} | {_fmt(row['steady_samples_per_s'], ',.0f')} | "
            f"{_fmt(row['speedup'], '.2f')}x | "
            f"{_fmt(row['scaling_efficiency'], '.0%')} | {row['train_time_s']:.1f} | {row['test_accuracy']:.2%} |"
        )
    lines += [
        "",
        "Speed-up is samples/s over the single-device baseline"
        + (f", both after each epoch's first {rows[0]['warmup_steps']} steps (the warm-up: library handles, "
           "algorithm choice, kernel loading, DDP's bucket rebuild)" if rows and rows[0]["speedup_from"]
           == "steady_samples_per_s" else ", over whole epochs (a mode had no steps after the warm-up)")
        + "; scaling efficiency is the speed-up "
        "divided by the devices the mode used (DDP: its GPUs, one per rank; DataParallel: its GPUs; "
        "on CPUs the ranks of one machine share its cores, so the ideal is the number of machines). "
        "Every mode trains on the same global batches; DDP deals each one out to its ranks in shares that "
        "differ by at most one sample, DataParallel splits it over its GPUs with torch.chunk.",
    ]
    for row in rows:
        if row["impossible"]:
            lines += ["", f"**Not a measurement of the mode:** {row['impossible']}."]
    if any(r.bare_dp for r in results):
        lines += ["", "**DataParallel ran on a CPU-only host**, where it has no GPUs to split the batch "
                      "over: it trained the bare module, so its numbers are the single-device numbers "
                      "again, not a measurement of DataParallel."]
    lines += ["", "![throughput](throughput.png)", "", "![loss during training](loss.png)", ""]
    return "\n".join(lines)


def throughput_png(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    # The figure the speed-ups compare: after the warm-up where every mode has one.
    values = [r[r["speedup_from"]] for r in rows]
    bars = axes.bar([r["mode"] for r in rows], values, color="tab:blue")
    axes.bar_label(bars, labels=[f"{v:,.0f}" for v in values])
    steady = rows and rows[0]["speedup_from"] == "steady_samples_per_s"
    axes.set(ylabel="training samples/s" + (" after the warm-up" if steady else ""), title="Throughput per mode")
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")
    plt.close(figure)


def loss_png(results: list[ModeResult], path: Path) -> None:
    """The training loss per window of steps, every mode on one chart, with each epoch's validation
    loss as points: a curve with a shape even for one epoch, on an axis from zero, so that modes a
    rounding error apart look as close as they are."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    # Equivalent modes draw the same curve: distinct dashes keep every line visible.
    for r, style, colour in zip(results, ("-", "--", ":", "-."), ("tab:blue", "tab:orange", "tab:green")):
        axes.plot([s["step"] for s in r.steps], [s["train_loss"] for s in r.steps], style, color=colour,
                  label=f"{r.mode}: training")
        steps_per_epoch = max(s["step"] for s in r.steps) / max(c["epoch"] for c in r.curves) if r.steps else 1
        axes.plot([c["epoch"] * steps_per_epoch for c in r.curves], [c["val_loss"] for c in r.curves], "o",
                  color=colour, fillstyle="none", label=f"{r.mode}: validation, end of epoch")
    axes.set_ylim(bottom=0)
    axes.set(xlabel="training step", ylabel="loss", title="Loss during training")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")
    plt.close(figure)
