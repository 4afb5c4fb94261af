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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tracking_overhead import on_off_medians  # noqa: E402


def breakdown(params: dict, on: bool) -> None:
    params["tracking"]["enabled"] = False  # the loop alone: MLflow's cost is tracking_overhead.py's
    if not on:
        params["train"].update(breakdown_steps=0, trace_steps=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="ddp", choices=["single", "dp", "ddp"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    medians = on_off_medians(args.mode, args.repeats, breakdown)

    print(f"\nStep breakdown overhead, `train --mode {args.mode}`, default params, median of {args.repeats}\n")
    print("| breakdown | training loop, s | whole command, s |")
    print("|---|---:|---:|")
    for on in (False, True):
        wall, loop = medians[on]
        print(f"| {'on' if on else 'off'} | {loop:.2f} | {wall:.1f} |")
    ratio = medians[True][1] / medians[False][1]
    print(f"\non / off: training loop {ratio:.3f}x (goal <= 1.05), whole command "
          f"{medians[True][0] / medians[False][0]:.3f}x")


if __name__ == "__main__":
    main()
