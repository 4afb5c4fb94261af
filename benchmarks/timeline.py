"""What each pytest run of a suite cost, and each test file in it: wall seconds and CPU seconds,
from the lines MNP_TEST_TIMELINE makes the tests write (tests/conftest.py), the most CPU first. The
suite is CPU-bound on 2 cores (docs/testing.md), so the CPU column says where a shorter suite must
come from.

    rm -f /tmp/timeline; MNP_TEST_TIMELINE=/tmp/timeline make test
    .venv/bin/python benchmarks/timeline.py /tmp/timeline

A run is one pytest command: `make test` makes two (the workers', then the `alone` tests), and the
fast tier's coverage run inside tests/test_fast_tier.py a third. Each run's span is from its first
test's start to its last test's end; a worker's busy seconds are the sum of its tests'. The tests
append to the file: start from none, or every run in it is listed. A line that is not one (cut
short when a run was killed) is counted and passed over.
"""

from __future__ import annotations

import argparse
import signal
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Run:
    started: float = float("inf")
    ended: float = 0.0
    busy: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # worker -> seconds
    rows: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0, 0.0]))


def read(path: str, per_test: bool) -> tuple[dict[str, Run], int]:
    runs: dict[str, Run] = defaultdict(Run)
    skipped = 0
    with open(path, errors="replace") as lines:
        for line in lines:
            try:
                run_id, worker, asked, got, ended, seconds, nodeid = line.split(maxsplit=6)
                asked_at, got_at, ended_at, used = float(asked), float(got), float(ended), float(seconds)
            except ValueError:
                skipped += 1
                continue
            run = runs[run_id]
            run.started, run.ended = min(run.started, asked_at), max(run.ended, ended_at)
            run.busy[worker] += ended_at - got_at
            row = run.rows[nodeid.strip() if per_test else nodeid.split("::")[0]]
            row[0] += 1
            row[1] += ended_at - got_at
            row[2] += used
    return runs, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", help="the file MNP_TEST_TIMELINE named")
    parser.add_argument("--tests", action="store_true", help="a row per test, not per file")
    args = parser.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the table quietly
    runs, skipped = read(args.timeline, args.tests)
    for number, run in enumerate(sorted(runs.values(), key=lambda run: run.started), 1):
        workers = ", ".join(f"{worker} {seconds:.0f} s" for worker, seconds in sorted(run.busy.items()))
        print(f"\nrun {number}: {run.ended - run.started:.0f} s from its first test to its last; busy: {workers}")
        print(f"{'test' if args.tests else 'file':<60} {'tests':>5} {'wall s':>8} {'CPU s':>8}")
        for key, (count, wall, cpu) in sorted(run.rows.items(), key=lambda item: -item[1][2]):
            print(f"{key[:60]:<60} {count:>5} {wall:>8.1f} {cpu:>8.1f}")
        totals = [sum(row[i] for row in run.rows.values()) for i in range(3)]
        print(f"{'all':<60} {totals[0]:>5} {totals[1]:>8.1f} {totals[2]:>8.1f}")
    if skipped:
        print(f"\n{skipped} line(s) passed over: not a test's line")


if __name__ == "__main__":
    main()
