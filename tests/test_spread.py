"""The step time's interval and the speed-up's, against distributions whose medians are known;
what the windows of measured steps cover; what other processes on the host take."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from pipeline import hostload, spread
from pipeline.breakdown import Probe
from tests.conftest import ROOT, build_stand_in_driver, process_cpu_seconds, subprocess_env

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`

MEDIAN_SINGLE, MEDIAN_DDP, SIGMA = 0.020, 0.012, 0.25


def steps(rng: np.random.Generator, median: float, n: int) -> list[float]:
    """Step times drawn from a log-normal distribution with a known median (right-skewed, as
    step times are)."""
    return list(median * np.exp(rng.normal(0.0, SIGMA, n)))


def test_the_median_steps_interval_covers_the_true_median_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    trials = [spread.median_interval(steps(rng, MEDIAN_SINGLE, 40)) for _ in range(300)]
    covered = sum(t.low <= MEDIAN_SINGLE <= t.high for t in trials) / len(trials)
    assert 0.90 <= covered <= 0.99, covered
    assert all(t.low <= t.value <= t.high for t in trials)


def test_the_speedups_interval_covers_the_true_ratio_from_both_modes_spread():
    rng = np.random.default_rng(2)
    truth = MEDIAN_SINGLE / MEDIAN_DDP
    trials = [spread.speedup_interval(steps(rng, MEDIAN_SINGLE, 40), steps(rng, MEDIAN_DDP, 40)) for _ in range(300)]
    covered = sum(t.low <= truth <= t.high for t in trials) / len(trials)
    assert 0.90 <= covered <= 0.99, covered
    # Wider than either mode's own relative interval: both spreads are in it.
    one = spread.median_interval(steps(rng, MEDIAN_DDP, 40))
    assert np.mean([t.relative_width for t in trials]) > one.relative_width


def test_intervals_shrink_as_the_measured_steps_grow():
    rng = np.random.default_rng(3)
    width = {n: np.mean([spread.median_interval(steps(rng, MEDIAN_SINGLE, n)).relative_width for _ in range(100)])
             for n in (20, 80)}
    assert 1.6 < width[20] / width[80] < 2.6, width  # about sqrt(4) = 2


def test_the_same_steps_give_the_same_interval():
    rng = np.random.default_rng(4)
    sample = steps(rng, MEDIAN_SINGLE, 30)
    assert spread.median_interval(sample) == spread.median_interval(list(sample))


def test_the_step_series_is_the_slowest_rank_at_each_step():
    breakdown = {"ranks": [{"step_s": [1.0, 5.0, 2.0]}, {"step_s": [3.0, 1.0, 2.5]}]}
    assert spread.step_series(breakdown) == [3.0, 5.0, 2.5]
    assert spread.step_series({"ranks": [{"median_s": {}}]}) == []  # results from before the series


@pytest.mark.parametrize("steps_in_epoch, repeats, windows", [(430, 5, 5), (430, 50, 20), (60, 5, 2), (25, 5, 1)])
def test_the_windows_spread_over_the_epoch_after_the_warm_up_without_overlapping(steps_in_epoch, repeats, windows):
    probe = Probe(torch.device("cpu"), window=20, trace_steps=2, warmup=10, repeats=repeats)
    probe.start_epoch(steps_in_epoch, measure=True)
    measured = probe.window_steps
    assert probe.windows == windows and len(measured) == len(set(measured)) == windows * probe.measured
    assert measured == sorted(measured) and measured[-1] < steps_in_epoch
    traced = [step for step in range(steps_in_epoch) if probe.in_trace(step)]
    assert len(traced) == 2 and not set(traced) & set(measured)
    if steps_in_epoch > 30:
        assert min(measured) == 10  # after the warm-up
    if windows > 1:
        assert measured[-1] == steps_in_epoch - 1  # the last window ends the epoch


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.alone
def test_another_process_busy_on_our_cores_is_counted_and_our_own_work_is_not():
    if len(os.sched_getaffinity(0)) < 1 or hostload.busy_seconds(hostload.cpus()) is None:
        pytest.skip("no /proc/stat")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # its start-up
        # One window, our own work and the other process's side by side: what a third process does
        # meanwhile on this shared machine can only add to both bounds' slack, whichever moment it picks.
        cpus = hostload.cpus()
        host_before, hog_before = hostload.busy_seconds(cpus), process_cpu_seconds(hog.pid)
        sample, started, own_before = hostload.Sample(), time.perf_counter(), time.process_time()
        busy(1.5)  # our own work: not another process's
        other = hostload.others([sample.finish()], time.perf_counter() - started)
        own_cores = (time.process_time() - own_before) / (time.perf_counter() - started)
        host_after, hog_after = hostload.busy_seconds(cpus), process_cpu_seconds(hog.pid)
        wall = time.perf_counter() - started
    finally:
        hog.kill()
        hog.wait()
    hog_cores = (hog_after - hog_before) / wall
    host_cores = sum(host_after[cpu] - host_before[cpu] for cpu in cpus) / wall  # a window around the sample's
    # Most of what the other process got of the cores (a core on an idle host, less where the machine
    # is busy with others) is counted; our own CPU time is not: counted as another's, it would make
    # the count the host's whole busy time.
    assert hog_cores > 0.25, f"the other process got {hog_cores:.2f} core(s): the host is too busy to tell"
    assert other["others_cores"] >= 0.6 * hog_cores, (other, hog_cores)
    assert other["others_cores"] <= host_cores - 0.6 * own_cores, (other, host_cores, own_cores)
    assert other["cores"] == len(os.sched_getaffinity(0)) and other["loadavg_1m"] >= 0


def test_other_processes_on_the_gpus_are_counted_beyond_one_of_ours_per_rank():
    dp = [{"gpu_processes": {"GPU-a": 1, "GPU-b": 2}}]  # DataParallel: one process on every GPU
    ddp = [{"gpu_processes": {"GPU-a": 1}}, {"gpu_processes": {"GPU-b": 1}}]
    shared = [{"gpu_processes": {"GPU-a": 2}}, {"gpu_processes": {"GPU-a": 2}}]  # two ranks on one GPU
    assert [hostload.gpu_others(r) for r in (dp, ddp, shared)] == [1, 0, 0]
    assert hostload.gpu_others([{"gpu_processes": None}]) is None  # no NVML: nothing to say
    found = spread.disturbances("ddp", [0.01] * 10, spread.Interval(0.01, 0.0099, 0.0101), None,
                                {"others_cores": 0.0, "cores": 16, "loadavg_1m": 1.0, "others_gpu_processes": 2})
    assert found == ["2 other compute process(es) shared ddp's GPU(s) (NVML, at the end of its last epoch)"]


def test_nvmls_process_list_is_read_as_the_stand_in_driver_answers(tmp_path):
    """Through pynvml and the stand-in libnvidia-ml.so.1 (tests/stand_in_libcuda.c), which lists
    processes as NVML does: the count first (no room: INSUFFICIENT_SIZE), then the records."""
    build_stand_in_driver(tmp_path)

    def seen(uuid: str = "GPU-0f", **env: str) -> str:
        done = subprocess.run([sys.executable, "-c", f"from pipeline import hostload; "
                               f"print(hostload.gpu_processes([{uuid!r}]))"], cwd=ROOT, capture_output=True,
                              text=True, env=subprocess_env(LD_LIBRARY_PATH=str(tmp_path), **env), timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert seen(STAND_IN_GPU_PROCESSES="3") == "{'GPU-0f': 3}"
    assert seen() == "{'GPU-0f': 0}"  # none: NVML answers at once
    assert seen("MIG-0f", STAND_IN_GPU_PROCESSES="3") == "None"  # not a name NVML finds
    assert seen(STAND_IN_NVML_INIT="999") == "None"  # a container whose NVML cannot start


def test_ranks_of_one_host_count_each_cpu_once_and_every_ranks_own_time():
    ranks = [{"host": "a", "cpus": (0, 1), "busy_s": {0: 9.0, 1: 9.0}, "own_s": 8.0, "loadavg_1m": 2.0},
             {"host": "a", "cpus": (1, 2), "busy_s": {1: 9.0, 2: 5.0}, "own_s": 8.0, "loadavg_1m": 2.5},
             {"host": "b", "cpus": (0,), "busy_s": {0: 10.0}, "own_s": 2.0, "loadavg_1m": 7.0}]
    found = hostload.others(ranks, wall_s=10.0)
    # Host a: 3 CPUs busy 23 s, the ranks' own 16 s: 0.7 cores of other work; host b: 0.8 of 1.
    assert found == {"others_cores": 0.8, "cores": 1, "loadavg_1m": 7.0, "others_gpu_processes": None}
    assert hostload.others(ranks[:2], wall_s=10.0)["others_cores"] == 0.7
    assert hostload.others([{**ranks[0], "busy_s": None}], wall_s=10.0) is None  # /proc/stat unreadable


def windowed(rng: np.random.Generator, median: float, windows: int, length: int, between: float) -> list[float]:
    """Steps in windows that each sit at their own level (the host's state while the window ran):
    log-normal levels about `median`, steps about their window's level."""
    levels = rng.normal(0.0, between, windows)
    return [median * np.exp(level + rng.normal(0.0, SIGMA / 2)) for level in levels for _ in range(length)]


def test_with_windows_at_different_levels_the_interval_resamples_the_windows():
    """Steps within a window are not independent draws: an interval over steps alone would cover the
    true median far less often than it says; resampling the windows first restores it."""
    rng = np.random.default_rng(5)
    draws = [windowed(rng, MEDIAN_SINGLE, 10, 20, between=0.15) for _ in range(200)]

    def covered(window: int) -> float:  # the share of draws whose interval holds the true median
        intervals = [spread.median_interval(d, window) for d in draws]
        return sum(i.low <= MEDIAN_SINGLE <= i.high for i in intervals) / len(draws)

    by_windows, by_steps = covered(10), covered(1)
    assert by_windows >= 0.85 and by_steps < 0.7, (by_windows, by_steps)
