"""Where a test run's CPU goes: the CPU seconds of every process that ends during a command, by
process name, from BSD process accounting, in units of one bare `python -c "import torch"`.

The suite is CPU-bound on 2 cores (docs/testing.md), so its wall time follows the CPU its processes
use; this says whose. With `--against VAR=VALUE` it runs the command twice, as given and with that
environment variable set, one after the other in the same hour, and prints both and their ratio:
whether a change to how the tests start processes (MNIST_PIPELINE_WARM=1, say) saves CPU.

Accounting is kernel-wide: another user's processes that end meanwhile count too (run it on a
quiet machine), and a process still running at the end (a server left behind) does not. A process
is filed under its name when it ended: a command whose last thread was jemalloc's background
thread shows as `jemalloc_bg_thd`. It goes on counting `--settle` seconds after the command, for
the warm servers that outlive it. CPU seconds are divided by the unit (a wall time) to read on the
same scale as benchmarks/suite_time.py, on a slow day as on a fast one. Needs root and the `acct`
package (`apt-get install acct`); it turns accounting off when done, so a system that keeps its own
(Debian's acct.service) must start it again.

    .venv/bin/python benchmarks/suite_cpu.py [--against VAR=VALUE] -- pytest -n 2 tests/test_tracking.py
"""

from __future__ import annotations

import argparse
import os
import shutil
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
TICK_S = 1 / os.sysconf("SC_CLK_TCK")  # acct v3 records user and system time in clock ticks
SHOWN = 8  # process names per run, the most CPU first
# A warm server ends 5 s after the processes it served (pipeline/runtime/warm_server.py LINGER_S).
SETTLE_S = 10.0
FRESH_COSTLY_S = 1.0  # a fresh process that used this much CPU paid for imports (started_as)


def accounted(command: list[str], env: dict[str, str], settle_s: float
              ) -> tuple[float, int, dict[str, tuple[int, float]], dict[str, tuple[int, float]]]:
    """(wall seconds, exit code, {process name: (processes, CPU seconds)}, {how it started:
    (processes, CPU seconds)}) of one run of `command`, and of the processes it left that end
    within `settle_s` after it."""
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        log = Path(tmp) / "acct"
        log.touch()
        subprocess.run(["accton", str(log)], check=True, stdout=subprocess.DEVNULL)
        try:
            started = time.monotonic()
            code = subprocess.run(command, cwd=ROOT, env=env).returncode
            wall = time.monotonic() - started
            time.sleep(settle_s)  # a process is written down when it ends: the warm servers' linger
        finally:
            subprocess.run(["accton", "off"], check=True, stdout=subprocess.DEVNULL)
        # One line a process: "name|v3|user ticks|system ticks|elapsed ticks|uid|gid|memory|io|pid|
        # ppid|flags|exit code|tty|start" (15 fields; only the name, first, may hold a "|").
        out = subprocess.run(["dump-acct", str(log)], check=True, capture_output=True, text=True,
                             errors="replace").stdout
    by_name: dict[str, tuple[int, float]] = {}
    by_start: dict[str, tuple[int, float]] = {}
    for line in out.splitlines():
        name, _, user, system, *_, flags, _, _, _ = (field.strip() for field in line.rsplit("|", 14))
        used = (float(user) + float(system)) * TICK_S
        for table, key in ((by_name, name), (by_start, started_as(flags, used))):
            count, cpu = table.get(key, (0, 0.0))
            table[key] = (count + 1, cpu + used)
    return wall, code, by_name, by_start


def started_as(flags: str, cpu_s: float) -> str:
    """How a process began, as the accounting's flags say: a fork that never called exec (F) runs
    on what its parent had imported; any other process started a program afresh, and one that
    used a second or more paid for its own start (a Python process: its imports, 1.5 s for torch
    alone) besides its work."""
    if "F" in flags:
        return "forks (no exec)"
    return "fresh, 1 CPU s or more" if cpu_s >= FRESH_COSTLY_S else "fresh, under 1 CPU s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="VAR=VALUE", help="also run the command with this variable set")
    parser.add_argument("--settle", type=float, default=SETTLE_S, metavar="S",
                        help=f"seconds to go on counting after the command, for what it left running "
                             f"(default {SETTLE_S:.0f})")
    parser.add_argument("command", nargs="+", help="the command to account for (after --)")
    args = parser.parse_args()
    missing = [tool for tool in ("accton", "dump-acct") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        sys.exit(f"suite_cpu: needs root and the acct package ({', '.join(missing) or 'not root'}): "
                 "apt-get install acct, then run it as root")
    if args.against and "=" not in args.against:
        sys.exit(f"suite_cpu: --against {args.against}: give VAR=VALUE")
    variants = [("as given", dict(os.environ))]
    if args.against:
        name, value = args.against.split("=", 1)
        variants.append((args.against, {**os.environ, name: value}))
    # A kill or hang-up of this script must still turn accounting off (the `finally` above).
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, _: sys.exit(128 + signum))
    units = [torch_unit(1) for _ in range(3)]
    runs = [(label, *accounted(args.command, env, args.settle)) for label, env in variants]
    units += [torch_unit(1) for _ in range(3)]
    unit = statistics.median(units)

    totals = []
    for label, wall, code, by_name, by_start in runs:
        total = sum(cpu for _, cpu in by_name.values())
        totals.append(total)
        print(f"\n{label}: {wall:.0f} s wall, exit code {code}; CPU {total:.0f} s = {total / unit:.0f} units")
        for heading, table, shown in (("process", by_name, SHOWN), ("started as", by_start, None)):
            print(f"{heading:<24} {'count':>6} {'CPU s':>8} {'share':>6} {'per one':>8}")
            for name, (count, cpu) in sorted(table.items(), key=lambda item: -item[1][1])[:shown]:
                print(f"{name:<24} {count:6d} {cpu:8.0f} {cpu / max(total, 1e-9):6.0%} {cpu / count:8.2f}")
    if len(totals) == 2:
        print(f"\nCPU with {args.against} / as given: {totals[1] / max(totals[0], 1e-9):.2f}")
    print(f"unit: a bare `import torch`, median of 6 (3 before, 3 after): {unit:.2f} s")
    return next((code for _, _, code, *_ in runs if code != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
