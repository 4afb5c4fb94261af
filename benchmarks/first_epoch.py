"""First epoch against the second, each training in a fresh process as the pipeline runs it.

Copies the project (as pipeline_overhead.py does), prepares all of MNIST once, then runs
`mnist-pipeline train --mode single` with 2 epochs, tracking off, on, and on without the
system-metrics sampler, interleaved (the order turned every repeat), and reads each epoch's time
from plots/train/single.csv. #13 asks for a first epoch at most 10% slower than the second, or a
measured reason why not; the settings tell whether MLflow's work beside the first epoch (the
sampler's thread, the outbox sending the run's parameters and inputs) is that reason.

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/first_epoch.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import ROOT, copy_project  # noqa: E402


# tracking.* settings compared
SETTINGS = {"off": {"enabled": False}, "on": {"enabled": True, "system_metrics": True},
            "on, no system metrics": {"enabled": True, "system_metrics": False}}


def epoch_times(project: Path, env: dict, tracking: dict) -> tuple[float, float]:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["epochs"] = 2
    params["tracking"].update(tracking)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["mnist-pipeline", "train", "--mode", "single"], cwd=project, env=env, check=True,
                   capture_output=True)
    with (project / "plots/train/single.csv").open() as handle:
        first, second = (float(row["epoch_time_s"]) for row in csv.DictReader(handle))
    return first, second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="trainings per setting; the median counts")
    args = parser.parse_args()
    source = Path(os.environ.get("MNIST_SOURCE", ROOT.parent / "shared" / "data" / "mnist")).resolve()
    env = {**os.environ, "MNIST_SOURCE": str(source),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    ratios: dict[str, list[tuple[float, float]]] = {setting: [] for setting in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="first-epoch-") as tmp:
        project = copy_project(Path(tmp))
        env["PYTHONPATH"] = str(project)
        subprocess.run(["mnist-pipeline", "prepare"], cwd=project, env=env, check=True, capture_output=True)
        for repeat in range(args.repeats):
            # Each repeat turns the order: whatever one run leaves behind (files still being
            # written back, a warm page cache) falls on each setting alike.
            order = list(SETTINGS)[repeat % len(SETTINGS):] + list(SETTINGS)[:repeat % len(SETTINGS)]
            for setting in order:
                first, second = epoch_times(project, env, SETTINGS[setting])
                ratios[setting].append((first, second))
                print(f"tracking {setting}: first epoch {first:.1f} s, second {second:.1f} s", flush=True)

    print(f"\nFirst epoch against the second, `train --mode single`, fresh process each (medians of {args.repeats})\n")
    print("| tracking | first epoch, s | second epoch, s | first / second |")
    print("|---|---:|---:|---:|")
    for setting, runs in ratios.items():
        first = statistics.median(f for f, _ in runs)
        second = statistics.median(s for _, s in runs)
        ratio = statistics.median(f / s for f, s in runs)
        print(f"| {setting} | {first:.1f} | {second:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
