"""How far a measured step time, and a speed-up, would move on a rerun: bootstrap intervals over
the measured steps, and the signs that something else ran beside a mode.

One definition of the step time everywhere (the comparison, metrics/, MLflow, the scaling model):
a measured step's wall time, data fetch to optimizer step, on whichever rank was slowest at that
step (the ranks of a synchronous step leave together, at the straggler's pace); the figure is the
median over the measured steps (train.breakdown_steps, in train.breakdown_repeats windows spread
over the last epoch). Every mode trains on the same global batches, so a speed-up over single is
single's median step over the mode's.

The intervals are percentile bootstraps (Efron and Tibshirani, 1993): the steps are resampled with
replacement, as if each were drawn independently from the mode's distribution of step times. Steps
next to each other share whatever else the host was doing, so one window's interval is narrower
than a rerun's spread would be; windows spread over the epoch (train.breakdown_repeats) catch more
of it. numpy only (compare does not load torch), seeded: the same steps give the same interval.
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
SLOWER_OUTSIDE = 1.30  # the epoch's mean steady step this many times the measured median
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
    """Each measured step's seconds on the rank slowest at it (results/breakdown/<mode>.json);
    empty when no step was measured (train.breakdown_steps: 0) or the results predate the series."""
    ranks = [r.get("step_s") for r in breakdown.get("ranks") or []]
    if not ranks or any(not r for r in ranks) or len({len(r) for r in ranks}) != 1:
        return []
    return [max(step) for step in zip(*ranks)]


def _resampled_medians(steps: list[float], rng: np.random.Generator) -> np.ndarray:
    values = np.asarray(steps, dtype=float)
    picks = rng.integers(0, len(values), size=(RESAMPLES, len(values)))
    return np.median(values[picks], axis=1)


def _percentiles(samples: np.ndarray) -> tuple[float, float]:
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def median_interval(steps: list[float]) -> Interval | None:
    """The median step time with its bootstrap interval; None without steps."""
    if not steps:
        return None
    low, high = _percentiles(_resampled_medians(steps, np.random.default_rng(SEED)))
    return Interval(float(np.median(steps)), low, high)


def speedup_interval(baseline: list[float], steps: list[float]) -> Interval | None:
    """baseline's median step over `steps`' median, each mode resampled on its own: the interval
    holds both modes' spread."""
    if not baseline or not steps:
        return None
    rng = np.random.default_rng(SEED)
    ratios = _resampled_medians(baseline, rng) / _resampled_medians(steps, rng)
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
        if mean_steady_s is not None and mean_steady_s > SLOWER_OUTSIDE * median.value:
            found.append(f"{mode}'s steps after the warm-up averaged {mean_steady_s * 1000:.2f} ms, "
                         f"{mean_steady_s / median.value:.1f}x the measured median: slowed outside the measured steps")
    if host and host.get("others_cores") is not None and host["others_cores"] > OTHERS_SHARE * host["cores"]:
        found.append(f"other processes kept {host['others_cores']:.1f} of the host's {host['cores']} core(s) "
                     f"busy while {mode} trained (load average {host['loadavg_1m']:.2f})")
    if host and host.get("others_gpu_processes"):
        found.append(f"{host['others_gpu_processes']} other compute process(es) shared {mode}'s GPU(s) "
                     "(NVML, at the end of its last epoch)")
    return found
