"""The test suite's wall time in units of one bare `python -c "import torch"`, so that the figure
means the same on a slow day as on a fast one (#37; #52: CI within 45 min on a slow day).

It times three bare torch imports before the suites and three after (the unit is the median of the
six: a machine that slowed down during the run counts both ways), runs each suite once, and prints
the table: each suite's minutes, its units, and each of its pytest runs' summary and minutes (`make
test` has two: the workers' part, then the tests marked `alone`). The suites are `make test-fast`
then `make test` in a clean clone of HEAD by default (a fresh venv, set up first and not counted),
`bash .ci/run` in a clean clone with `--ci` (as CI runs it: the venv's set-up counted), or any one
command after `--`.

A slow day, made on purpose: `--load N` runs N processes beside everything timed, the unit
included, each copying 64 MiB from one buffer to another without end, at the suite's priority, so
that they take both CPU time and memory bandwidth. A fraction is one more process, busy that part
of every 100 ms. #52's slow day had a unit of 3.8 to 4.6 s (1.5 to 1.7 s on a fast one): on this
machine's 2 cores `--load 2` made 2.8 to 3.8 s, `--load 2.5` 3.2 to 5.2 s, `--load 3` 4.1 to 5.4 s
(docs/testing.md): the machine's own noise is as large as a half process's.

    .venv/bin/python benchmarks/suite_time.py                  # both tiers, in a clean clone of HEAD
    .venv/bin/python benchmarks/suite_time.py --ci --load 2.5  # CI as it runs, on a made slow day
    .venv/bin/python benchmarks/suite_time.py -- pytest -q tests/test_config.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import torch_unit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=* ?(\d+ (?:passed|failed)[^\n]*?) in ([\d.]+)s", re.M)
# One process of the made slow day: CPU time and memory bandwidth, no end of its own; busy a
# fraction ({share}) of every 100 ms (1: always).
LOAD = """import time
a = bytearray(64 << 20)
b = bytearray(64 << 20)
while True:
    period = time.monotonic()
    while time.monotonic() - period < {share} * 0.1:
        b[:] = a
    time.sleep(max(0.0, period + 0.1 - time.monotonic()))
"""


@contextlib.contextmanager
def load(processes: float):
    """LOAD running for the block, in `processes` processes (a fraction: one busy that share of
    the time), ended with it however it ends."""
    whole, part = divmod(processes, 1)
    shares = [1.0] * int(whole) + ([part] if part else [])
    started = []
    try:
        for share in shares:
            started.append(subprocess.Popen([sys.executable, "-c", LOAD.format(share=share)]))
        yield
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="time `bash .ci/run` in a clean clone, set-up included")
    parser.add_argument("--load", type=float, default=0, metavar="N",
                        help="N memory-bound busy processes beside the run, the unit included (a slow day); "
                             "a fraction is one busy that share of the time")
    parser.add_argument("command", nargs="*", help="the suite to time (default: make test-fast, then make test, "
                                                   "in a clean clone)")
    args = parser.parse_args()
    if args.ci and args.command:
        parser.error("--ci times .ci/run: give no command with it")
    # Killed (a cancelled job, `timeout`), it still ends its load: `load`'s finally runs on SystemExit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # The suite measures today's slowness itself (tests/conftest.py): a pinned one would hide --load's.
    env = {key: value for key, value in os.environ.items() if key not in ("MNP_TEST_SLOWNESS", "PYTEST_TIMEOUT")}
    env["CI"] = "true"
    # Beside this checkout, as CI's clone is: the tests find ../shared (MNIST, reference files) there.
    with tempfile.TemporaryDirectory(prefix=f"{ROOT.name}-suite-", dir=ROOT.parent) as tmp:
        if args.command:
            cwd, commands = ROOT, [args.command]
        else:
            cwd = Path(tmp)
            subprocess.run(["git", "clone", "-q", str(ROOT), str(cwd)], check=True)
            if args.ci:
                commands = [["bash", ".ci/run"]]
            else:
                commands = [["make", "test-fast"], ["make", "test"]]
                subprocess.run(["make", "install"], cwd=cwd, check=True, env=env)  # set up, not timed
        with load(args.load):
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
        # make test: its two pytest runs, each with its own minutes
        parts = " + ".join(f"{summary} ({float(seconds) / 60:.1f} min)"
                           for summary, seconds in SUMMARY.findall(done.stdout))
        print(f"{' '.join(command)[:40]:<40} {wall / 60:8.1f} {wall / unit:7.0f}   "
              f"{parts or f'exit code {done.returncode}'}")
    print(f"unit: a bare `import torch`, median of 6 (3 before, 3 after): {unit:.2f} s "
          f"(before {statistics.median(before):.2f} s, after {statistics.median(after):.2f} s)"
          + (f"; beside {args.load:g} busy process(es) (--load)" if args.load else ""))
    return max(done.returncode for _, _, done in runs)


if __name__ == "__main__":
    sys.exit(main())
