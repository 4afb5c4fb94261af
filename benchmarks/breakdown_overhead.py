"""What the step breakdown costs: the default training with it on (train.breakdown_steps and
train.trace_steps as in params.yaml: the comm hook, the stamps, the profiled steps and their trace
export) and off (both 0).

Runs `mnist-pipeline train --mode MODE` on the full prepared data, tracking off, alternating on and
off, and prints the median of the training loop's time (results/train/<mode>.json, which includes
the profiled steps) and of the whole command, with the ratio on/off. The goal: at most 1.05.

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/breakdown_overhead.py --mode ddp
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


def run_once(project: Path, mode: str, on: bool, env: dict) -> tuple[float, float]:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["tracking"]["enabled"] = False
    if not on:
        params["train"].update(breakdown_steps=0, trace_steps=0)
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stages", "train", "--mode", mode], cwd=project, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    loop = json.loads((project / "results/train" / f"{mode}.json").read_text())["train_time_s"]
    return wall, loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="ddp", choices=["single", "dp", "ddp"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        for name in ("pipeline", "stages", "deploy"):
            shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "PYTHONPATH": str(project)}
        if "MNIST_SOURCE" in env:  # the stages run in the copy: a relative path must not move with them
            env["MNIST_SOURCE"] = str(Path(env["MNIST_SOURCE"]).resolve())
        shutil.copy(ROOT / "params.yaml", project / "params.yaml")
        subprocess.run([sys.executable, "-m", "stages", "prepare"], cwd=project, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.repeats):
            for on in (False, True):  # alternating, so drift in machine load hits both alike
                results[on].append(run_once(project, args.mode, on, env))

    print(f"\nStep breakdown overhead, `train --mode {args.mode}`, default params, median of {args.repeats}\n")
    print("| breakdown | training loop, s | whole command, s |")
    print("|---|---:|---:|")
    medians = {}
    for on in (False, True):
        wall = statistics.median(w for w, _ in results[on])
        loop = statistics.median(lp for _, lp in results[on])
        medians[on] = (wall, loop)
        print(f"| {'on' if on else 'off'} | {loop:.2f} | {wall:.1f} |")
    ratio = medians[True][1] / medians[False][1]
    print(f"\non / off: training loop {ratio:.3f}x (goal <= 1.05), whole command "
          f"{medians[True][0] / medians[False][0]:.3f}x")


if __name__ == "__main__":
    main()
