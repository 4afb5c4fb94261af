"""The comparison report: what each parallel mode bought, as a Markdown table and two plots."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import spread
from pipeline.config import distributed
from pipeline.plotting import pyplot


@dataclass(frozen=True)
class ModeResult:
    mode: str
    train: dict  # results/train/<mode>.json
    eval: dict  # results/eval/<mode>.json
    curves: list[dict]  # plots/train/<mode>.csv rows, one per epoch
    steps: list[dict]  # plots/steps/<mode>.csv rows: the training loss per window of steps
    step_times: list[float] = field(default_factory=list)  # the measured steps' seconds (spread.step_series)
    windows: int = 0  # how many windows of steps they came from

    @property
    def devices(self) -> int:
        """How many devices the mode trained on: what a perfect speed-up would equal. On a CPU
        every mode shares the same cores, so ranks add no hardware and the ideal stays 1x."""
        if self.train["device"] == "cpu":
            # Ranks on one machine share its cores; each further machine adds its own.
            return self.train.get("nodes", 1) if distributed(self.mode) else 1
        if distributed(self.mode):
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
        return cores * (self.train.get("nodes", 1) if distributed(self.mode) else 1) if cores else None

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
    # Speed-ups compare the measured steps' medians where every mode has them (pipeline.spread: the
    # same global batch in every mode, so the step time's ratio is the throughput's), with their
    # intervals. Without them (train.breakdown_steps: 0), throughputs: the steady states where every
    # mode has one (a fast GPU's short epoch is mostly warm-up, which says nothing about the mode).
    throughput = "steady_samples_per_s" if all(steady(r.train) for r in results) else "samples_per_s"
    by_steps = all(r.step_times for r in results)
    # Neither measured steps nor a steady state in every mode: whole epochs of warm-up, whose ratio
    # says nothing about the modes (on 2 cores it reached 4.47x). No speed-up, and a warning why.
    too_short = not by_steps and throughput == "samples_per_s"
    rows = []
    for r in results:
        step = spread.median_interval(r.step_times, r.windows)
        if too_short and r is not baseline:
            speedup = None
        elif r is baseline:  # its own steps over themselves: exactly 1
            speedup = spread.Interval(1.0, 1.0, 1.0)
        elif baseline and by_steps:
            speedup = spread.speedup_interval(baseline.step_times, r.step_times, baseline.windows, r.windows)
        elif baseline:
            value = r.train[throughput] / baseline.train[throughput]
            speedup = spread.Interval(value, value, value)
        else:
            speedup = None
        efficiency = speedup.scaled(1 / r.devices) if speedup else None
        mean_steady = r.train.get("steady_step_s")
        rows.append({
            "mode": r.mode,
            "world_size": r.train["world_size"],
            # DDP's ranks as machines x processes on each (older metrics files lack the split).
            "layout": (f"{r.train['nodes']} × {r.train['procs_per_node']}"
                       if distributed(r.mode) and "nodes" in r.train else None),
            # Samples of each global batch per rank (ddp) or per GPU (dp); older metrics lack it.
            "shares": r.train.get("batch_shares", "n/a"),
            "device": r.train["device_name"] + (" (bare module: no GPU to split over)" if r.bare_dp else ""),
            "epochs": r.train["epochs"],
            "samples_per_s": r.train["samples_per_s"],
            "steady_samples_per_s": steady(r.train),
            "warmup_steps": r.train.get("warmup_steps"),
            "throughput": throughput,
            "speedup_from": "median_step" if by_steps and baseline else throughput,
            "step": step,
            "steps_measured": len(r.step_times),
            "windows": r.windows,
            "speedup": speedup.value if speedup else None,
            "speedup_interval": speedup if by_steps and speedup else None,
            "scaling_efficiency": efficiency.value if efficiency else None,
            "efficiency_interval": efficiency if by_steps and efficiency else None,
            "impossible": impossible(r.mode, speedup.value if speedup else None, r.speedup_bound, r.train["device"]),
            "too_short": too_short_to_time(r) if too_short else None,
            "disturbed": spread.disturbances(r.mode, r.step_times, step, mean_steady, r.train.get("host_load")),
            "host_load": r.train.get("host_load"),
            "train_time_s": r.train["train_time_s"],
            "state_mb_per_rank": r.train.get("state_mb_per_rank"),  # older results lack it
            "peak_memory_mb_per_rank": r.train.get("peak_memory_mb_per_rank"),  # GPUs only
            "test_accuracy": r.eval.get("accuracy"),  # a classifier's (MNIST's)
            "test_loss": r.eval.get("loss"),  # older results lack these
            # Another workload's metrics, each a mean over the test set (results/eval/<mode>.json).
            "test_scores": {name: value for name, value in r.eval.items()
                            if name not in ("accuracy", "loss", "count") and isinstance(value, (int, float))},
            "val_accuracy": r.train.get("val_accuracy"),
            "val_loss": r.train.get("val_loss"),
        })
    return rows


def warnings(row: dict) -> list[str]:
    """Everything that says a row's timing is not the mode's alone: compare prints, reports and
    tags each (it warns and does not fail: the models and accuracies stay good, and a rerun on a
    quiet host re-measures; docs/comparison.md)."""
    return ([row[key] for key in ("too_short", "impossible") if row.get(key)]) + row["disturbed"]


def unmeasured(results: list[ModeResult]) -> str:
    """Why no step was measured, as the first mode's results say it (older ones: the setting)."""
    return next((r.train["unmeasured"] for r in results if r.train.get("unmeasured")), "train.breakdown_steps is 0")


def too_short_to_time(r: ModeResult) -> str:
    """Why a mode's run had nothing to time, from its own results (older ones do not say)."""
    reasons = [r.train.get("no_steady") or "no epoch had a step after the warm-up (train.throughput_warmup_steps)",
               *([f"no step was measured: {r.train['unmeasured']}"] if r.train.get("unmeasured") else [])]
    return (f"{r.mode}: too short to time, so no speed-up: {'; '.join(reasons)}. Train on more data "
            "(MNIST: data.train_limit), with a smaller train.batch_size or more steps per epoch")


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


def val_scores_csv(results: list[ModeResult]) -> str:
    """Every mode's validation scores per epoch in one long table (epoch, mode, metric, value), for
    DVC's chart of them, a panel per metric whatever the workload names its metrics (MNIST:
    accuracy); the loss where the workload has none."""
    lines = ["epoch,mode,metric,value"]
    for r in results:
        for row in r.curves:
            names = [key for key in row if key.startswith("val_") and key != "val_loss"] or ["val_loss"]
            lines += [f"{int(row['epoch'])},{r.mode},{name[len('val_'):]},{row[name]!r}" for name in names]
    return "\n".join(lines) + "\n"


def mode_metrics(row: dict) -> dict:
    """metrics/<mode>.json: what `dvc metrics show` and `dvc exp show` compare, the test set's
    accuracy and loss first; numbers only (the mode's facts are in results/, its curves in plots/)."""
    step, speedup, efficiency = row["step"], row["speedup_interval"], row["efficiency_interval"]
    values = {**row["test_scores"], "accuracy": row["test_accuracy"], "loss": row["test_loss"],
              # The throughput beside the speed-up: after the warm-up where every mode has one.
              "samples_per_s": row[row["throughput"]], "speedup": row["speedup"],
              "scaling_efficiency": row["scaling_efficiency"], "train_time_s": row["train_time_s"],
              "val_accuracy": row["val_accuracy"], "val_loss": row["val_loss"],
              # How many things say the timing was disturbed (0: none): sortable in `dvc exp show`.
              "timing_warnings": len(warnings(row))}
    if step:
        values.update(step_ms=step.value * 1000, step_ms_low=step.low * 1000, step_ms_high=step.high * 1000)
    if speedup:
        values.update(speedup_low=speedup.low, speedup_high=speedup.high,
                      scaling_efficiency_low=efficiency.low, scaling_efficiency_high=efficiency.high)
    # DVC orders the columns by name: accuracy and loss (on the test set) lead.
    return {key: round(value, 6) if isinstance(value, float) else value
            for key, value in sorted(values.items()) if value is not None}


def interval_text(interval: spread.Interval | None, pattern: str, unit: str = "", scale: float = 1.0) -> str:
    """"0.83x (0.80-0.86)": the value, then its 95% interval where it has one."""
    if interval is None:
        return "n/a"
    value = f"{format(interval.value * scale, pattern)}{unit}"
    if interval.low == interval.high == interval.value:
        return value
    return f"{value} ({format(interval.low * scale, pattern)}-{format(interval.high * scale, pattern)})"


def score_names(rows: list[dict]) -> list[str]:
    """The test set's scores the tables show: a classifier's accuracy, then every other metric its
    workload's evaluation gave, in that order; else the loss."""
    names = ["accuracy"] if any(row["test_accuracy"] is not None for row in rows) else []
    for row in rows:
        names += [name for name in row["test_scores"] if name not in names]
    return names or ["loss"]


def score_cell(row: dict, name: str) -> str:
    if name == "accuracy":
        return "n/a" if row["test_accuracy"] is None else f"{row['test_accuracy']:.2%}"
    if name == "loss":
        return _fmt(row["test_loss"], ".4f")
    return _fmt(row["test_scores"].get(name), ".4g")


def console_table(rows: list[dict]) -> str:
    """The comparison in a terminal's width: what `dvc repro` ends with."""
    names = score_names(rows)
    widths = [max(13, len(f"test {name}")) for name in names]
    scores = "".join(f" {f'test {name}':>{width}}" for name, width in zip(names, widths))
    # The throughput the speed-up divides: after the warm-up where every mode has one, as the
    # report's column of that name (its "samples/s" is each epoch's mean).
    rate = "samples/s after warm-up" if rows and rows[0]["throughput"] == "steady_samples_per_s" else "samples/s"
    lines = [f"{'mode':<7}{scores} {rate:>10} {'step ms (95%)':>20} {'speed-up (95%)':>20} "
             f"{'training time':>14}"]
    for r in rows:
        speedup = r["speedup_interval"] or (spread.Interval(r["speedup"], r["speedup"], r["speedup"])
                                            if r["speedup"] is not None else None)
        scores = "".join(f" {score_cell(r, name):>{width}}" for name, width in zip(names, widths))
        lines.append(f"{r['mode']:<7}{scores} {r[r['throughput']]:>{max(10, len(rate))},.0f} "
                     f"{interval_text(r['step'], '.2f', scale=1000):>20} {interval_text(speedup, '.2f', 'x'):>20} "
                     f"{r['train_time_s']:>12.1f} s")
    return "\n".join(lines)


def state_cell(row: dict) -> str:
    """A rank's tensor bytes of weights, gradients and optimizer state; on GPUs its allocator's peak
    beside them (activations and workspaces too)."""
    peak = row.get("peak_memory_mb_per_rank")
    return _fmt(row["state_mb_per_rank"], ".2f") + ("" if peak is None else f" (peak {peak:,.0f})")


def _fmt(value, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def markdown(rows: list[dict], results: list[ModeResult]) -> str:
    names = score_names(rows)
    lines = [
        "# Data-parallel modes compared",
        "",
        "| mode | world size (nodes × processes) | batch per rank or GPU | device | epochs | samples/s "
        "| samples/s after warm-up | step (ms, 95% interval) | speed-up over single | scaling efficiency "
        "| training time (s) | weights, gradients, optimizer state per rank (MiB; on GPUs, the allocator's peak) | "
        + " | ".join(f"test {name}" for name in names) + " |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(names),
    ]
    for row in rows:
        world = f"{row['world_size']} ({row['layout']})" if row["layout"] else str(row["world_size"])
        speedup = row["speedup_interval"] or (None if row["speedup"] is None else spread.Interval(
            row["speedup"], row["speedup"], row["speedup"]))
        efficiency = row["efficiency_interval"] or (None if row["scaling_efficiency"] is None else spread.Interval(
            row["scaling_efficiency"], row["scaling_efficiency"], row["scaling_efficiency"]))
        lines.append(
            f"| {row['mode']} | {world} | {row['shares']} | {row['device']} | {row['epochs']} | "
            f"{row['samples_per_s']:,.0f} | {_fmt(row['steady_samples_per_s'], ',.0f')} | "
            f"{interval_text(row['step'], '.2f', scale=1000)} | {interval_text(speedup, '.2f', 'x')} | "
            f"{interval_text(efficiency, '.0f', '%', scale=100)} | {row['train_time_s']:.1f} | "
            f"{state_cell(row)} | " + " | ".join(score_cell(row, name) for name in names) + " |"
        )
    first = rows[0] if rows else None
    if first and first["speedup_from"] == "median_step":
        how = (f"Speed-up is single's median step time over the mode's: every mode trains on the same global "
               f"batches, so it says how much faster a typical step runs (the samples/s columns are the "
               f"epochs' means, slow steps included). The step time is a measured step's wall time on the "
               f"rank slowest at it, its median over {first['steps_measured']} steps of the last epoch "
               f"({first['windows']} window(s) of train.breakdown_steps spread over the steps after the "
               f"warm-up, train.breakdown_repeats); in brackets, 95% bootstrap intervals (the windows "
               f"resampled, then the steps in each), the speed-up's from both modes' steps; they hold the "
               f"spread within one training, not between two"
               + (". DDP's comm timer, a hook that stays once attached, has the last window to itself: DDP's "
                  "step times come from the others, and every mode's samples/s after warm-up ends where that "
                  "window starts" if first["windows"] > 1 and any(row["mode"] == "ddp" for row in rows) else ""))
    elif any(row.get("too_short") for row in rows):
        how = ("No speed-up: every mode's run was too short to time (its warnings below say why), and "
               "whole epochs of warm-up say nothing about the modes")
    else:
        how = ("Speed-up is samples/s over the single-device baseline"
               + (f", both after each epoch's first {first['warmup_steps']} steps (the warm-up: library handles, "
                  "algorithm choice, kernel loading, DDP's bucket rebuild)" if first else "")
               + f", with no interval: no step was measured ({unmeasured(results)})")
    lines += [
        "",
        how + "; scaling efficiency is the speed-up "
        "divided by the devices the mode used (DDP: its GPUs, one per rank; DataParallel: its GPUs; "
        "on CPUs the ranks of one machine share its cores, so the ideal is the number of machines). "
        "Every mode trains on the same global batches; DDP deals each one out to its ranks in shares that "
        "differ by at most one sample, DataParallel splits it over its GPUs with torch.chunk.",
    ]
    for row in rows:
        if row["impossible"]:
            lines += ["", f"**Not a measurement of the mode:** {row['impossible']}."]
        for found in row["disturbed"]:
            lines += ["", f"**Timing disturbed:** {found}."]
    if any(r.bare_dp for r in results):
        lines += ["", "**DataParallel ran on a CPU-only host**, where it has no GPUs to split the batch "
                      "over: it trained the bare module, so its numbers are the single-device numbers "
                      "again, not a measurement of DataParallel."]
    lines += ["", "How steady each mode's timing was (the last epoch):", "",
              "| mode | steps measured (windows) | slow steps (over 1.5x the median) | mean step after warm-up (ms) "
              "| other processes' cores (of the mode's) | load average |", "|---|---:|---:|---:|---:|---:|"]
    for row, r in zip(rows, results):
        slow = (sum(t > spread.SLOW * row["step"].value for t in r.step_times) if row["step"] else None)
        host = row["host_load"] or {}
        lines.append(f"| {row['mode']} | {row['steps_measured']} ({row['windows']}) | {_fmt(slow, 'd')} | "
                     f"{_fmt(r.train.get('steady_step_s') and r.train['steady_step_s'] * 1000, '.2f')} | "
                     + (f"{host['others_cores']:.2f} (of {host['cores']})" if host else "n/a")
                     + (f"; {host['others_gpu_processes']} on its GPUs" if host.get("others_gpu_processes") else "")
                     + f" | {_fmt(host.get('loadavg_1m'), '.2f')} |")
    lines += ["", "![throughput](throughput.png)", "", "![loss during training](loss.png)", ""]
    return "\n".join(lines)


def throughput_png(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    # The throughput beside the speed-ups: after the warm-up where every mode has one.
    values = [r[r["throughput"]] for r in rows]
    bars = axes.bar([r["mode"] for r in rows], values, color="tab:blue")
    axes.bar_label(bars, labels=[f"{v:,.0f}" for v in values])
    steady = rows and rows[0]["throughput"] == "steady_samples_per_s"
    axes.set(ylabel="training samples/s" + (" after the warm-up" if steady else ""), title="Throughput per mode")
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")
    plt.close(figure)


# Each mode's line in loss.png, the same whichever modes trained.
LOSS_STYLES = {"single": ("-", "tab:blue"), "dp": ("--", "tab:orange"), "ddp": (":", "tab:green"),
               "fsdp": ("-.", "tab:red")}


def loss_png(results: list[ModeResult], path: Path) -> None:
    """The training loss per window of steps, every mode on one chart, with each epoch's validation
    loss as points: a curve with a shape even for one epoch, on an axis from zero, so that modes a
    rounding error apart look as close as they are."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    # Equivalent modes draw the same curve: distinct dashes keep every line visible.
    for r in results:
        style, colour = LOSS_STYLES[r.mode]
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
