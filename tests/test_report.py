"""The comparison table for a DDP run that spanned machines."""

import csv
import io

import pytest

from pipeline.loop import loss_windows
from pipeline.report import (ModeResult, comparison_rows, console_table, markdown, mode_metrics, modes_csv,
                             val_scores_csv, warnings)

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`


def result(mode: str, samples_per_s: float, **train) -> ModeResult:
    base = {"world_size": 1, "device": "cpu", "device_name": "cpu (2 cores)", "dp_devices": 1, "epochs": 2,
            "samples_per_s": samples_per_s, "steady_samples_per_s": samples_per_s, "train_time_s": 10.0}
    return ModeResult(mode, {**base, **train}, {"accuracy": 0.98}, [], [])


def test_a_multi_node_ddp_run_shows_nodes_times_processes_and_counts_each_machine():
    results = [result("single", 1000.0),
               result("ddp", 3000.0, world_size=4, nodes=2, procs_per_node=2)]
    rows = comparison_rows(results)
    table = markdown(rows, results)
    assert "| ddp | 4 (2 × 2) | n/a |" in table and "| single | 1 | n/a |" in table
    # CPU ranks on one machine share its cores, but a second machine is more hardware: the ideal
    # speed-up is 2x, so 3x over single is 150% efficient (and says the baseline was starved).
    ddp = next(r for r in rows if r["mode"] == "ddp")
    assert ddp["speedup"] == 3.0 and ddp["scaling_efficiency"] == 1.5


def test_metrics_from_before_the_split_still_read():
    results = [result("single", 1000.0), result("ddp", 900.0, world_size=2)]
    assert "| ddp | 2 |" in markdown(comparison_rows(results), results)


def test_the_table_shows_each_ranks_share_of_the_batch():
    results = [result("single", 1000.0, batch_shares="128"),
               result("ddp", 900.0, world_size=3, nodes=1, procs_per_node=3, batch_shares="43/43/42")]
    table = markdown(comparison_rows(results), results)
    assert "| ddp | 3 (1 × 3) | 43/43/42 |" in table and "| single | 1 | 128 |" in table


def test_many_shares_are_shown_as_runs():
    from pipeline.parallel import batch_shares, shares_label

    assert shares_label(batch_shares(128, 24)) == "6x8/5x16"
    assert shares_label(batch_shares(128, 8)) == "16/16/16/16/16/16/16/16"


def test_speedups_compare_the_steady_state_when_every_mode_has_one():
    results = [result("single", 1000.0, steady_samples_per_s=2000.0, warmup_steps=10),
               result("ddp", 1500.0, world_size=2, steady_samples_per_s=5000.0, warmup_steps=10)]
    rows = comparison_rows(results)
    assert [r["speedup"] for r in rows] == [1.0, 2.5]  # not 1.5: the whole epochs' warm-up left out
    table = markdown(rows, results)
    assert "| 1,500 | 5,000 | n/a | 2.50x |" in table and "after each epoch's first 10 steps" in table
    assert "with no interval: no step was measured" in table
    # An epoch no longer than the warm-up, and no step measured: whole epochs of warm-up are no
    # speed-up (on 2 cores their ratio reached 4.47x); the warning names the settings that took the steps.
    results[1].train.update(steady_samples_per_s=None, steps_per_epoch=2, unmeasured="the last epoch's 2 step(s) "
                            "all went to train.trace_steps (2)",
                            no_steady="each epoch's 2 step(s) are all warm-up (train.throughput_warmup_steps: 10)")
    rows = comparison_rows(results)
    assert [r["speedup"] for r in rows] == [1.0, None] and "No speed-up" in markdown(rows, results)
    assert warnings(rows[1]) == [
        "ddp: too short to time, so no speed-up: each epoch's 2 step(s) are all warm-up "
        "(train.throughput_warmup_steps: 10); no step was measured: the last epoch's 2 step(s) all went to "
        "train.trace_steps (2). Train on more data (MNIST: data.train_limit), with a smaller train.batch_size or more "
        "steps per epoch"]
    assert "speedup" not in mode_metrics(rows[1]) and mode_metrics(rows[1])["timing_warnings"] == 1


def test_the_metrics_dvc_compares_are_numbers_led_by_test_accuracy():
    results = [result("single", 1000.0, steady_samples_per_s=1100.0, val_accuracy=0.97, val_loss=0.1),
               result("ddp", 900.0, steady_samples_per_s=1650.0, world_size=2, val_accuracy=0.97, val_loss=0.1)]
    rows = comparison_rows(results)
    single, ddp = (mode_metrics(row) for row in rows)
    # DVC sorts columns by name: the test set's accuracy and loss come first.
    assert sorted(ddp)[0] == "accuracy" and ddp["accuracy"] == 0.98 and "loss" not in ddp  # no test loss given
    assert ddp["samples_per_s"] == 1650.0 and ddp["speedup"] == 1.5  # the steady figure the speed-up divides
    assert all(isinstance(v, (int, float)) for v in (*single.values(), *ddp.values()))
    lines = console_table(rows).splitlines()
    assert len(lines) == 3 and lines[2].split() == ["ddp", "98.00%", "1,650", "n/a", "1.50x", "10.0", "s"]
    assert " samples/s after warm-up " in lines[0]  # the rate the speed-up divides, named as the report names it
    whole_epochs = comparison_rows([result("single", 1000.0, steady_samples_per_s=None)])
    assert " samples/s " in console_table(whole_epochs).splitlines()[0] and "warm-up" not in console_table(whole_epochs)
    assert ddp["timing_warnings"] == 0 and "step_ms" not in ddp  # no step measured: no step time


def test_without_single_there_is_no_speedup_and_nothing_breaks():
    rows = comparison_rows([result("ddp", 900.0, world_size=2)])
    line = console_table(rows).splitlines()[1]
    assert "speedup" not in mode_metrics(rows[0]) and line.split()[4] == "n/a" and line.endswith(" s")


def test_every_modes_curve_in_one_table():
    a = ModeResult("single", {}, {}, [], [{"step": 5.0, "epoch": 1.0, "train_loss": 1.5}])
    b = ModeResult("ddp", {}, {}, [], [{"step": 5.0, "epoch": 1.0, "train_loss": 1.25}])
    rows = list(csv.DictReader(io.StringIO(modes_csv([a, b], "steps", ("step", "epoch", "train_loss")))))
    assert rows == [{"mode": "single", "step": "5", "epoch": "1", "train_loss": "1.5"},
                    {"mode": "ddp", "step": "5", "epoch": "1", "train_loss": "1.25"}]


def test_loss_windows_are_means_over_the_global_batches():
    # 45 steps: windows of ceil(45 / 20) = 3 steps, the last one of 45 - 42 = 3; a shorter last batch
    # weighs by its samples, so a window's loss is the mean over its samples.
    sums, lens = [2.0 * 10] * 44 + [1.0 * 4], [10] * 44 + [4]
    windows = loss_windows(sums, lens, first_step=101)
    assert len(windows) == 15 and windows[0] == [103, 2.0] and windows[-1][0] == 145
    assert windows[-1][1] == (2.0 * 20 + 1.0 * 4) / 24


def test_a_speedup_the_hardware_cannot_give_is_flagged_in_the_table_and_its_row():
    """As seen during a queued sweep on 2 cores: single slowed by another job, ddp '6.72x'."""
    results = [result("single", 500.0, cpu_cores=2),
               result("ddp", 3360.0, world_size=2, nodes=1, procs_per_node=2, cpu_cores=2),
               result("dp", 900.0, cpu_cores=2)]
    rows = {r["mode"]: r for r in comparison_rows(results)}
    assert rows["ddp"]["impossible"].startswith("ddp's speed-up of 6.72x is more than its 2 core(s) allow")
    assert rows["dp"]["impossible"] is None and rows["single"]["impossible"] is None  # 1.8x: within 2 cores
    assert "**Not a measurement of the mode:** ddp's speed-up of 6.72x" in markdown(list(rows.values()), results)
    # On GPUs the bound is the devices: 8 ranks may give 7.9x, never 9x.
    gpu = [result("single", 1000.0, device="cuda"),
           result("ddp", 7900.0, device="cuda", world_size=8), result("ddp", 9000.0, device="cuda", world_size=8)]
    assert [r["impossible"] is not None for r in comparison_rows(gpu)] == [False, False, True]
    assert "8 device(s)" in comparison_rows(gpu)[2]["impossible"]
    # Results from before the cores were recorded: no bound, no claim.
    assert all(r["impossible"] is None for r in comparison_rows([result("single", 100.0), result("ddp", 900.0)]))


def stepped(mode: str, steps: list[float], **train) -> ModeResult:
    return ModeResult(mode, {**result(mode, 1000.0).train, **train}, {"accuracy": 0.98}, [], [], steps, 2)


def test_speedups_are_median_step_ratios_with_intervals_the_same_in_every_view():
    single = stepped("single", [0.020 + 0.0002 * (i % 7) for i in range(40)], cpu_cores=2)
    ddp = stepped("ddp", [0.012 + 0.0001 * (i % 5) for i in range(40)], world_size=2, nodes=1, procs_per_node=2,
                  cpu_cores=2)
    rows = comparison_rows([single, ddp])
    row = rows[1]
    medians = sorted(single.step_times)[19:21], sorted(ddp.step_times)[19:21]
    assert row["speedup"] == pytest.approx(sum(medians[0]) / sum(medians[1]))
    interval = row["speedup_interval"]
    assert interval.low < row["speedup"] < interval.high and interval.high - interval.low < 0.2
    assert row["efficiency_interval"] == row["speedup_interval"]  # one machine's CPU ranks: the ideal is 1x
    two = stepped("ddp", ddp.step_times, world_size=4, nodes=2, procs_per_node=2, cpu_cores=2)
    across = comparison_rows([single, two])[1]  # a second machine is more hardware: the ideal is 2x
    assert across["efficiency_interval"].low == pytest.approx(across["speedup_interval"].low / 2)
    text = f"{interval.value:.2f}x ({interval.low:.2f}-{interval.high:.2f})"
    step = row["step"]
    step_text = f"{step.value * 1000:.2f} ({step.low * 1000:.2f}-{step.high * 1000:.2f})"
    assert text in console_table(rows).splitlines()[2] and step_text in console_table(rows).splitlines()[2]
    table = markdown(rows, [single, ddp])
    assert f"| {step_text} | {text} |" in table and "median over 40 steps" in table and "2 window(s)" in table
    metrics = mode_metrics(row)
    assert (metrics["speedup"], metrics["speedup_low"], metrics["speedup_high"]) == tuple(
        round(v, 6) for v in (interval.value, interval.low, interval.high))
    assert metrics["step_ms"] == round(step.value * 1000, 6) and metrics["timing_warnings"] == 0
    assert list(metrics) == sorted(metrics)  # DVC's order


def test_a_disturbed_mode_is_named_with_what_disturbed_it():
    """Bursts of slow steps, a busy host, an epoch slower than its measured steps: each in the report."""
    quiet = [0.010 + 0.0001 * (i % 5) for i in range(40)]
    bursty = quiet[:30] + [0.030] * 10  # a quarter of the steps three times as long
    single = stepped("single", quiet, cpu_cores=2)
    ddp = stepped("ddp", bursty, world_size=2, cpu_cores=2, steady_step_s=0.025,
                  host_load={"others_cores": 1.4, "cores": 2, "loadavg_1m": 3.5})
    rows = comparison_rows([single, ddp])
    assert rows[0]["disturbed"] == []
    found = rows[1]["disturbed"]
    assert any("10 of ddp's 40 measured steps took over 1.5x its median" in f for f in found)
    assert any("other processes kept 1.4 of the host's 2 core(s) busy while ddp trained (load average 3.50)" in f
               for f in found)
    assert any("averaged 25.00 ms a step after the warm-up, its measured steps 15.15 ms: the measured windows "
               "missed a slow spell" in f for f in found)
    table = markdown(rows, [single, ddp])
    assert table.count("**Timing disturbed:** ") == len(found)
    assert "| ddp | 40 (2) | 10 | 25.00 | 1.40 (of 2) | 3.50 |" in table
    assert mode_metrics(rows[1])["timing_warnings"] == len(found)


def test_every_score_of_the_workload_has_its_column_in_both_tables():
    """A regression's evaluation gives no accuracy but two metrics of its own: each heads a column
    of the console table and of comparison.md; MNIST's shows its accuracy alone."""
    scores = {"abs_error": 0.31234, "squared_error": 0.2, "loss": 0.2, "count": 40}
    results = [ModeResult(mode, result(mode, 1000.0).train, scores, [], []) for mode in ("single", "ddp")]
    rows = comparison_rows(results)
    lines = console_table(rows).splitlines()
    assert lines[0].split()[:5] == ["mode", "test", "abs_error", "test", "squared_error"], lines
    assert lines[2].split()[:3] == ["ddp", "0.3123", "0.2"], lines
    table = [line for line in markdown(rows, results).splitlines() if line.startswith("|")][:4]
    assert table[0].endswith("| test abs_error | test squared_error |") and table[1].count("|") == table[0].count("|")
    assert table[3].startswith("| ddp |") and table[3].endswith("| 0.3123 | 0.2 |"), table
    mnist = comparison_rows([result("single", 1000.0)])
    assert console_table(mnist).splitlines()[0].split()[:3] == ["mode", "test", "accuracy"]
    assert markdown(mnist, [result("single", 1000.0)]).splitlines()[2].endswith("| test accuracy |")


def test_the_loss_chart_draws_a_line_for_every_mode(tmp_path, monkeypatch):
    """fsdp too: each mode its own style, whichever modes trained (a zip over three colours once
    dropped the fourth mode's line)."""
    from pipeline import report
    from pipeline.config import MODES
    from pipeline.plotting import pyplot

    assert set(report.LOSS_STYLES) == set(MODES)
    drawn = []
    plt = pyplot()
    monkeypatch.setattr(plt, "close", lambda figure: drawn.extend(
        line.get_label() for line in figure.axes[0].get_lines()))
    steps = [{"step": float(step), "epoch": 1.0, "train_loss": 1.0 / step} for step in (1, 2)]
    results = [ModeResult(mode, {}, {}, [{"epoch": 1.0, "val_loss": 0.4}], steps) for mode in MODES]
    report.loss_png(results, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert drawn == [f"{mode}: {what}" for mode in MODES for what in ("training", "validation, end of epoch")]


def test_validation_scores_are_one_long_table_whatever_the_workload_names_them():
    mnist = ModeResult("ddp", {}, {}, [{"epoch": 1.0, "val_loss": 0.3, "val_accuracy": 0.9, "train_loss": 0.5}], [])
    table = ModeResult("single", {}, {}, [{"epoch": 2.0, "val_loss": 0.2, "val_abs_error": 0.25,
                                          "val_squared_error": 0.2}], [])
    only_loss = ModeResult("dp", {}, {}, [{"epoch": 1.0, "val_loss": 0.125}], [])
    rows = list(csv.DictReader(io.StringIO(val_scores_csv([mnist, table, only_loss]))))
    assert rows == [{"epoch": "1", "mode": "ddp", "metric": "accuracy", "value": "0.9"},
                    {"epoch": "2", "mode": "single", "metric": "abs_error", "value": "0.25"},
                    {"epoch": "2", "mode": "single", "metric": "squared_error", "value": "0.2"},
                    {"epoch": "1", "mode": "dp", "metric": "loss", "value": "0.125"}]
