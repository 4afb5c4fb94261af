"""What MLflow tracking costs: the default training with tracking on and off.

Runs `mnist-pipeline train --mode MODE` on the full prepared data with the default params.yaml,
alternating tracking.enabled true/false, and prints the median wall time of the whole command and of
the training loop alone (results/train/<mode>.json), with the ratio on/off. Tracking goes to a fresh
SQLite store in a temporary copy of the project.

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/tracking_overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_once(project: Path, mode: str, tracking: bool, env: dict) -> tuple[float, float]:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["tracking"]["enabled"] = tracking
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stages", "train", "--mode", mode], cwd=project, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    loop = json.loads((project / "results/train" / f"{mode}.json").read_text())["train_time_s"]
    return wall, loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="single", choices=["single", "dp", "ddp"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        for name in ("pipeline", "stages"):
            shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "PYTHONPATH": str(project)}
        if "MNIST_SOURCE" in env:  # the stages run in the copy: a relative path must not move with them
            env["MNIST_SOURCE"] = str(Path(env["MNIST_SOURCE"]).resolve())
        env.pop("MLFLOW_TRACKING_URI", None)
        shutil.copy(ROOT / "params.yaml", project / "params.yaml")
        subprocess.run([sys.executable, "-m", "stages", "prepare"], cwd=project, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.repeats):
            for tracking in (False, True):  # alternating, so drift in machine load hits both alike
                results[tracking].append(run_once(project, args.mode, tracking, env))

    print(f"\nMLflow tracking overhead, `train --mode {args.mode}`, default params, median of {args.repeats}\n")
    print("| tracking | whole command, s | training loop, s |")
    print("|---|---:|---:|")
    medians = {}
    for tracking in (False, True):
        wall = statistics.median(w for w, _ in results[tracking])
        loop = statistics.median(lp for _, lp in results[tracking])
        medians[tracking] = (wall, loop)
        print(f"| {'on' if tracking else 'off'} | {wall:.1f} | {loop:.1f} |")
    print(f"\non / off: whole command {medians[True][0] / medians[False][0]:.3f}x, "
          f"training loop {medians[True][1] / medians[False][1]:.3f}x")


if __name__ == "__main__":
    main()
