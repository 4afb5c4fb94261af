"""What one `mlflow server` costs to start, with MLflow's GenAI job execution on (MLflow's default)
and off (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`, as the project starts its servers: `make ui`,
docs/mlflow.md, docs/multi-node.md and the tests).

With job execution on, the server starts a job runner and its huey consumers besides its web
worker, each a Python process that imports MLflow, and they keep running (their memory included)
for jobs this pipeline never submits. Each round starts a server on a fresh SQLite store as the
tests do, waits until /health answers, waits `--settle` seconds (what a server serving a test does
meanwhile), reads the memory of every process it started, and stops it. CPU seconds and processes
are from BSD process accounting (benchmarks/suite_cpu.py: root and the `acct` package), CPU in units
of one bare `python -c "import torch"`. Median of `--rounds`, the two settings taking turns.

Then the basic-auth server docs/multi-node.md starts: MLflow checks the password of every request
against its hash (werkzeug's scrypt, costly by design) unless `auth_cache_ttl_seconds` keeps a
successful check for a while. It sends `--requests` authenticated requests to a server without and
with a 60 s cache, and prints the server's CPU per request (from /proc) and each request's time.

    .venv/bin/python benchmarks/mlflow_server_cost.py
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import torch_unit  # noqa: E402
from suite_cpu import accounted  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"on (MLflow's default)": "true", "off (the project's)": "false"}
START_TIMEOUT_S = 120


def one_server(settle_s: float, out: Path) -> None:
    """Start, wait for /health and `settle_s` more, write when it answered and the memory of all it
    started to `out` (JSON), stop: the command accounted for, run as `mlflow_server_cost.py --one`."""
    with tempfile.TemporaryDirectory(prefix="mlflow-cost-") as home, serving(Path(home)) as (server, _, answered):
        time.sleep(settle_s)
        out.write_text(json.dumps({"answered_s": answered, "rss_mb": session_rss_mb(server.pid)}))
    time.sleep(2)  # the job runner's consumers end after the server: accounting writes them down then


@contextlib.contextmanager
def serving(home: Path, *args: str, env: dict[str, str] | None = None):
    """An `mlflow server` on a free port with a SQLite store in `home`, once /health answers:
    (its process, its URL, seconds until it answered); stopped (its whole session) on leaving."""
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    deadline = started + START_TIMEOUT_S
    server = subprocess.Popen(
        [str(ROOT / ".venv/bin/mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{home}/mlflow.db", "--artifacts-destination", f"{home}/artifacts", *args],
        cwd=home, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except urllib.error.HTTPError:  # an answer all the same (basic-auth asks for an account)
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit(f"mlflow server ended ({server.returncode}) before it answered")
                if time.monotonic() > deadline:
                    sys.exit(f"mlflow server did not answer within {START_TIMEOUT_S} s")
                time.sleep(0.2)
        yield server, f"http://127.0.0.1:{port}", time.monotonic() - started
    finally:
        stop_session(server)


def stop_session(server: subprocess.Popen) -> None:
    """SIGTERM to the server's whole session, SIGKILL to what is left after 60 s."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(server.pid, sig)
        try:
            server.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def auth_cost(ttl_s: int, requests: int) -> tuple[float, float]:
    """(server CPU ms, wall ms) per authenticated request to a basic-auth server (docs/multi-node.md)
    whose credential cache keeps a successful check `ttl_s` seconds (0: MLflow's default, none)."""
    password = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="mlflow-auth-cost-") as tmp:
        home = Path(tmp)
        (home / "basic_auth.ini").write_text(
            f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{home / 'auth.db'}\n"
            "admin_username = admin\nauthorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            f"auth_cache_ttl_seconds = {ttl_s}\n")
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
               "MLFLOW_AUTH_CONFIG_PATH": str(home / "basic_auth.ini"), "MLFLOW_AUTH_ADMIN_PASSWORD": password,
               "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}
        with serving(home, "--app-name", "basic-auth", env=env) as (server, url, _):
            token = base64.b64encode(f"admin:{password}".encode()).decode()
            request = urllib.request.Request(f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default",
                                             headers={"Authorization": f"Basic {token}"})
            urllib.request.urlopen(request, timeout=30).read()  # the first: every route and table warmed
            cpu, started = session_cpu_s(server.pid), time.monotonic()
            for _ in range(requests):
                urllib.request.urlopen(request, timeout=30).read()
            wall = time.monotonic() - started
            return (session_cpu_s(server.pid) - cpu) / requests * 1e3, wall / requests * 1e3


def session_cpu_s(sid: int) -> float:
    """The CPU seconds so far of every process in session `sid`."""
    ticks = 0
    for stat in session_files(sid, "stat"):
        fields = stat.rpartition(")")[2].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return ticks / os.sysconf("SC_CLK_TCK")


def session_files(sid: int, name: str) -> list[str]:
    """/proc/PID/`name` of every process in session `sid` (the server and all it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == sid:
                found.append((entry / name).read_text())
        except (OSError, ValueError):  # ended meanwhile
            continue
    return found


def session_rss_mb(sid: int) -> float:
    """The resident memory of every process in session `sid`, summed."""
    kilobytes = 0
    for status in session_files(sid, "status"):
        kilobytes += sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return kilobytes / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=10.0, metavar="S",
                        help="seconds the server runs after it answers (default 10)")
    parser.add_argument("--requests", type=int, default=200, help="authenticated requests per round (default 200)")
    parser.add_argument("--one", type=Path, metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_server(args.settle, args.one)
        return 0
    missing = [tool for tool in ("accton", "dump-acct") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        sys.exit(f"mlflow_server_cost: needs root and the acct package ({', '.join(missing) or 'not root'}): "
                 "apt-get install acct, then run it as root")
    # A kill or hang-up must still turn accounting off (suite_cpu.accounted's `finally`).
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, _: sys.exit(128 + signum))
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

    caches = {"none (MLflow's default)": 0, "60 s (docs/multi-node.md)": 60}
    costs: dict[str, list[tuple[float, float]]] = {label: [] for label in caches}
    for _ in range(args.rounds):
        for label, ttl in caches.items():
            costs[label].append(auth_cost(ttl, args.requests))
    print(f"\n{'basic-auth credential cache':<28} {'server CPU ms per request':>26} {'ms per request':>15}")
    per_request = {}
    for label, rows in costs.items():
        cpu_ms, wall_ms = (statistics.median(column) for column in zip(*rows))
        per_request[label] = cpu_ms
        print(f"{label:<28} {cpu_ms:26.1f} {wall_ms:15.1f}")
    none, cached = per_request.values()
    print(f"none / 60 s: server CPU per request {none / cached:.1f}x (median of {args.rounds}, "
          f"{args.requests} requests each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
