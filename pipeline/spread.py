"""How far a measured step time, and a speed-up, would move on a rerun: bootstrap intervals over
the measured steps, and the signs that something else ran beside a mode.

One definition of the step time everywhere (the comparison, metrics/, MLflow, the scaling model):
a measured step's wall time, data fetch to optimizer step, on whichever rank was slowest at that
step (the ranks of a synchronous step leave together, at the straggler's pace); the figure is the
median over the measured steps (train.breakdown_steps, in train.breakdown_repeats windows spread
over the last epoch). Every mode trains on the same global batches, so a speed-up over single is
single's median step over the mode's: how much faster a typical step runs. The epoch's samples/s,
slow steps included, stands beside it; far from it, the measured windows are flagged.

The intervals are two-stage percentile bootstraps (Efron and Tibshirani, 1993; Davison and Hinkley,
1997, for clustered data): the windows are resampled with replacement, then the steps within each,
because steps next to each other share whatever else the host was doing at that moment and are not
independent draws. The spread between windows is in the interval; the spread between two trainings
(start-up, the host's state on the day) is not. numpy only (compare does not load torch), seeded:
the same steps give the same interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
# What counts as disturbed (compare warns, it does not fail: the training's results stay usable).
WIDE = 0.20  # the median step's interval spans more than 20% of it
SLOW = 1.5  # a step this many times the median is a slow step ...
SLOW_SHARE = 0.10  # ... and this share of slow steps (2 at least) is a second mode in the spread
SLOWER_OUTSIDE = 1.30  # the epoch's mean step after the warm-up this far from the measured steps' mean
OTHERS_SHARE = 0.25  # other processes kept this share of the mode's cores busy


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    def scaled(self, factor: float) -> Interval:
        return Interval(self.value * factor, self.low * factor, self.high * factor)

    @property
    def relative_width(self) -> float:
        return (self.high - self.low) / self.value if self.value else float("inf")


def step_series(breakdown: dict) -> list[float]:
    """Each measured step's seconds on the rank slowest at it (results/breakdown/<mode>.json),
    window after window; empty when no step was measured (train.breakdown_steps: 0) or the results
    predate the series."""
    ranks = [r.get("step_s") for r in breakdown.get("ranks") or []]
    if not ranks or any(not r for r in ranks) or len({len(r) for r in ranks}) != 1:
        return []
    return [max(step) for step in zip(*ranks)]


def windows_of(breakdown: dict) -> int:
    """How many equal windows the measured steps came in (1 for results from before windows)."""
    return max((r.get("windows") or 1 for r in breakdown.get("ranks") or []), default=1)


def _blocks(steps: list[float], windows: int) -> np.ndarray:
    """The steps as (windows, steps per window); one block where they do not divide evenly."""
    windows = windows if windows > 1 and len(steps) % windows == 0 else 1
    return np.asarray(steps, dtype=float).reshape(windows, -1)


def _resampled_medians(steps: list[float], windows: int, rng: np.random.Generator) -> np.ndarray:
    """Two-stage bootstrap medians: windows drawn with replacement, then steps within each drawn
    window. Steps next to each other share the host's state at that moment, so resampling steps
    alone would make the interval as narrow as if every step were independent; resampling windows
    carries the spread between them. With one window it is the plain bootstrap over steps."""
    blocks = _blocks(steps, windows)
    count, length = blocks.shape
    chosen = rng.integers(0, count, size=(RESAMPLES, count, 1))
    picks = rng.integers(0, length, size=(RESAMPLES, count, length))
    return np.median(blocks[chosen, picks].reshape(RESAMPLES, -1), axis=1)


def _percentiles(samples: np.ndarray) -> tuple[float, float]:
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def median_interval(steps: list[float], windows: int = 1) -> Interval | None:
    """The median step time with its bootstrap interval; None without steps."""
    if not steps:
        return None
    low, high = _percentiles(_resampled_medians(steps, windows, np.random.default_rng(SEED)))
    return Interval(float(np.median(steps)), low, high)


def speedup_interval(baseline: list[float], steps: list[float], baseline_windows: int = 1,
                     windows: int = 1) -> Interval | None:
    """baseline's median step over `steps`' median, each mode resampled on its own: the interval
    holds both modes' spread."""
    if not baseline or not steps:
        return None
    rng = np.random.default_rng(SEED)
    ratios = _resampled_medians(baseline, baseline_windows, rng) / _resampled_medians(steps, windows, rng)
    low, high = _percentiles(ratios)
    return Interval(float(np.median(baseline) / np.median(steps)), low, high)


def disturbances(mode: str, steps: list[float], median: Interval | None, mean_steady_s: float | None,
                 host: dict | None) -> list[str]:
    """What in `mode`'s timing says something else ran beside it, one phrase each (empty: nothing)."""
    found = []
    if median is not None and median.relative_width > WIDE:
        found.append(f"{mode}'s median step is uncertain by {median.relative_width:.0%} of itself "
                     f"({median.low * 1000:.2f}-{median.high * 1000:.2f} ms)")
    if median is not None:
        slow = sum(step > SLOW * median.value for step in steps)
        if slow >= max(2, SLOW_SHARE * len(steps)):
            found.append(f"{slow} of {mode}'s {len(steps)} measured steps took over {SLOW:g}x its median "
                         "(a second mode in the spread: something ran in bursts)")
        measured = float(np.mean(steps))
        if mean_steady_s is not None and not 1 / SLOWER_OUTSIDE <= mean_steady_s / measured <= SLOWER_OUTSIDE:
            found.append(f"{mode}'s last epoch averaged {mean_steady_s * 1000:.2f} ms a step after the warm-up, "
                         f"its measured steps {measured * 1000:.2f} ms: the measured windows "
                         + ("missed a slow spell" if mean_steady_s > measured else "caught a slow spell"))
    if host and host.get("others_cores") is not None and host["others_cores"] > OTHERS_SHARE * host["cores"]:
        found.append(f"other processes kept {host['others_cores']:.1f} of the host's {host['cores']} core(s) "
                     f"busy while {mode} trained (load average {host['loadavg_1m']:.2f})")
    if host and host.get("others_gpu_processes"):
        found.append(f"{host['others_gpu_processes']} other compute process(es) shared {mode}'s GPU(s) "
                     "(NVML, at the end of its last epoch)")
    return found
