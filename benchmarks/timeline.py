"""What each test file of a run cost: wall seconds and CPU seconds, from the lines MNP_TEST_TIMELINE
makes the tests write (tests/conftest.py), the most CPU first. The suite is CPU-bound on 2 cores
(docs/testing.md), so the CPU column says where a shorter suite must come from.

    rm -f /tmp/timeline; MNP_TEST_TIMELINE=/tmp/timeline make test
    .venv/bin/python benchmarks/timeline.py /tmp/timeline

The tests append to the file: start from none, or every run in it is summed. A line that is not
one (cut short when a run was killed) is counted and passed over.
"""

from __future__ import annotations

import argparse
import signal
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", help="the file MNP_TEST_TIMELINE named")
    parser.add_argument("--tests", action="store_true", help="a row per test, not per file")
    args = parser.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the table quietly
    wall: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    skipped = 0
    with open(args.timeline, errors="replace") as lines:
        for line in lines:
            try:
                _worker, _asked, got, ended, seconds, nodeid = line.split(maxsplit=5)
                took, used = float(ended) - float(got), float(seconds)
            except ValueError:
                skipped += 1
                continue
            key = nodeid.strip() if args.tests else nodeid.split("::")[0]
            wall[key] += took
            cpu[key] += used
            count[key] += 1
    print(f"{'file' if not args.tests else 'test':<60} {'tests':>5} {'wall s':>8} {'CPU s':>8}")
    for key in sorted(cpu, key=cpu.get, reverse=True):
        print(f"{key[:60]:<60} {count[key]:>5} {wall[key]:>8.1f} {cpu[key]:>8.1f}")
    print(f"{'all':<60} {sum(count.values()):>5} {sum(wall.values()):>8.1f} {sum(cpu.values()):>8.1f}")
    if skipped:
        print(f"{skipped} line(s) passed over: not a test's line")


if __name__ == "__main__":
    main()
