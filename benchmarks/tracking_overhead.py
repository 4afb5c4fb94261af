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
from typing import Callable

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_once(project: Path, mode: str, params: dict, env: dict) -> tuple[float, float]:
    """(the whole command's wall time, the training loop's time) of one `train --mode MODE`."""
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stages", "train", "--mode", mode], cwd=project, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    loop = json.loads((project / "results/train" / f"{mode}.json").read_text())["train_time_s"]
    return wall, loop


def on_off_medians(mode: str, repeats: int, setting: Callable[[dict, bool], None]) -> dict[bool, tuple[float, float]]:
    """Median (wall, loop) seconds of `train --mode MODE` with `setting(params, on)` applied to the
    default params.yaml, off and on alternating (so drift in machine load hits both alike), in a
    temporary copy of the project with its own prepared data."""
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        for name in ("pipeline", "stages", "deploy"):
            shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "PYTHONPATH": str(project)}
        if "MNIST_SOURCE" in env:  # the stages run in the copy: a relative path must not move with them
            env["MNIST_SOURCE"] = str(Path(env["MNIST_SOURCE"]).resolve())
        env.pop("MLFLOW_TRACKING_URI", None)
        shutil.copy(ROOT / "params.yaml", project / "params.yaml")
        subprocess.run([sys.executable, "-m", "stages", "prepare"], cwd=project, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(repeats):
            for on in (False, True):
                params = yaml.safe_load((ROOT / "params.yaml").read_text())
                setting(params, on)
                results[on].append(run_once(project, mode, params, env))
    return {on: (statistics.median(w for w, _ in runs), statistics.median(lp for _, lp in runs))
            for on, runs in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="single", choices=["single", "dp", "ddp"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    medians = on_off_medians(args.mode, args.repeats, lambda params, on: params["tracking"].update(enabled=on))

    print(f"\nMLflow tracking overhead, `train --mode {args.mode}`, default params, median of {args.repeats}\n")
    print("| tracking | whole command, s | training loop, s |")
    print("|---|---:|---:|")
    for tracking in (False, True):
        wall, loop = medians[tracking]
        print(f"| {'on' if tracking else 'off'} | {wall:.1f} | {loop:.1f} |")
    print(f"\non / off: whole command {medians[True][0] / medians[False][0]:.3f}x, "
          f"training loop {medians[True][1] / medians[False][1]:.3f}x")


if __name__ == "__main__":
    main()
