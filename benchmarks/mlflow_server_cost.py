"""What one `mlflow server` costs to start, with MLflow's GenAI job execution on (MLflow's default)
and off (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`, as the project starts its servers: `make ui`,
docs/mlflow.md, docs/multi-node.md and the tests).

With job execution on, the server starts a job runner and four huey consumers besides its web
worker, each a Python process that imports MLflow, and they keep running (their memory included)
for jobs this pipeline never submits. Each round starts a server on a fresh SQLite store as the
tests do, waits until /health answers, waits `--settle` seconds (what a server serving a test does
meanwhile), reads the memory of every process it started, and stops it. CPU seconds and processes
are from BSD process accounting (benchmarks/suite_cpu.py: root and the `acct` package), CPU in units
of one bare `python -c "import torch"`. Median of `--rounds`, the two settings taking turns.

    .venv/bin/python benchmarks/mlflow_server_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import torch_unit  # noqa: E402
from suite_cpu import accounted  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"on (MLflow's default)": "true", "off (the project's)": "false"}


def one_server(settle_s: float, out: Path) -> None:
    """Start, wait for /health and `settle_s` more, write when it answered and the memory of all it
    started to `out` (JSON), stop: the command accounted for, run as `mlflow_server_cost.py --one`."""
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="mlflow-cost-") as home:
        started = time.monotonic()
        server = subprocess.Popen(
            [str(ROOT / ".venv/bin/mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{home}/mlflow.db", "--artifacts-destination", f"{home}/artifacts"],
            cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit(f"mlflow server ended ({server.returncode}) before it answered")
                time.sleep(0.2)
        answered = time.monotonic() - started
        time.sleep(settle_s)
        out.write_text(json.dumps({"answered_s": answered, "rss_mb": session_rss_mb(server.pid)}))
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        time.sleep(2)  # the job runner's consumers end after the server: accounting writes them down then


def session_rss_mb(sid: int) -> float:
    """The resident memory of every process in session `sid` (the server and all it started)."""
    total = 0
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == sid:
                for line in (entry / "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except (OSError, ValueError):  # ended meanwhile
            continue
    return total / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=10.0, metavar="S",
                        help="seconds the server runs after it answers (default 10)")
    parser.add_argument("--one", type=Path, metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_server(args.settle, args.one)
        return 0
    if os.geteuid() != 0:
        sys.exit("mlflow_server_cost: needs root and the acct package (apt-get install acct)")
    unit = torch_unit(3)
    results: dict[str, list[tuple[float, int, float, float]]] = {label: [] for label in SETTINGS}
    for _ in range(args.rounds):
        for label, value in SETTINGS.items():
            env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": value}
            with tempfile.TemporaryDirectory(prefix="mlflow-cost-") as tmp:
                out = Path(tmp) / "measured.json"
                command = [sys.executable, __file__, "--one", str(out), "--settle", str(args.settle)]
                _, code, _, by_start = accounted(command, env, settle_s=0)
                if code != 0 or not out.is_file():
                    sys.exit(f"mlflow_server_cost: a server with job execution {value} failed (exit code {code})")
                measured = json.loads(out.read_text())
            processes = sum(count for count, _ in by_start.values())
            cpu = sum(cpu for _, cpu in by_start.values())
            results[label].append((cpu, processes, measured["answered_s"], measured["rss_mb"]))
    print(f"\n{'job execution':<24} {'CPU s':>7} {'units':>6} {'processes':>10} {'answers in s':>13} "
          f"{'memory MB':>10}")
    medians = {}
    for label, rows in results.items():
        cpu, processes, answered, rss = (statistics.median(column) for column in zip(*rows))
        medians[label] = (cpu, rss)
        print(f"{label:<24} {cpu:7.1f} {cpu / unit:6.1f} {processes:10.0f} {answered:13.1f} {rss:10.0f}")
    (on_cpu, on_rss), (off_cpu, off_rss) = medians.values()
    print(f"on / off: CPU {on_cpu / off_cpu:.1f}x, memory {on_rss / off_rss:.1f}x (median of {args.rounds}); "
          f"unit: a bare `import torch`, {unit:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
