"""The test suite's wall time in units of one bare `python -c "import torch"`, so that the figure
means the same on a slow day and a fast one (#37: the full suite at most 450 units, the fast tier
under 60).

It times three bare torch imports before the suites and three after (the unit is the median of the
six: a machine that slowed down during the run counts both ways), runs each suite once, and prints
the table: each suite's minutes, its units, and pytest's own summary line. The suites are `make
test-fast` then `make test` in a clean clone of HEAD by default (what CI runs: a fresh venv
included, which is not counted: the clone's venv is set up first), or any one command after `--`.

    .venv/bin/python benchmarks/suite_time.py              # both tiers, in a clean clone of HEAD
    .venv/bin/python benchmarks/suite_time.py -- pytest -q tests/test_config.py
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import torch_unit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=* ?(\d+ (?:passed|failed)[^\n]*?) in [\d.]+s", re.M)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="*", help="the suite to time (default: make test-fast, then make test, "
                                                   "in a clean clone)")
    args = parser.parse_args()
    env = {**os.environ, "CI": "true"}
    # Beside this checkout, as CI's clone is: the tests find ../shared (MNIST, reference files) there.
    with tempfile.TemporaryDirectory(prefix=f"{ROOT.name}-suite-", dir=ROOT.parent) as tmp:
        if args.command:
            cwd, commands = ROOT, [args.command]
        else:
            cwd, commands = Path(tmp), [["make", "test-fast"], ["make", "test"]]
            subprocess.run(["git", "clone", "-q", str(ROOT), str(cwd)], check=True)
            subprocess.run(["make", "install"], cwd=cwd, check=True, env=env)  # set up, not timed
        before = [torch_unit(1) for _ in range(3)]
        runs = []
        for command in commands:
            started = time.monotonic()
            done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            runs.append((command, time.monotonic() - started, done))
        after = [torch_unit(1) for _ in range(3)]
    for _, _, done in runs:
        sys.stdout.write(done.stdout[-4000:])
    unit = statistics.median(before + after)
    print(f"\n{'suite':<40} {'minutes':>8} {'units':>7}   result")
    for command, wall, done in runs:
        summary = " + ".join(SUMMARY.findall(done.stdout))  # make test: its two pytest runs
        print(f"{' '.join(command)[:40]:<40} {wall / 60:8.1f} {wall / unit:7.0f}   "
              f"{summary or f'exit code {done.returncode}'}")
    print(f"unit: a bare `import torch`, median of 6 (3 before, 3 after): {unit:.2f} s "
          f"(before {statistics.median(before):.2f} s, after {statistics.median(after):.2f} s)")
    return max(done.returncode for _, _, done in runs)


if __name__ == "__main__":
    sys.exit(main())
