"""fsdp against ddp, side by side in one run: each one's step time and each rank's weights,
gradients and optimizer state (#56).

Both train the same model on the same global batches through the stage (`mnist-pipeline train
--mode ddp`, then `--mode fsdp`, alternating, `--repeats` times each) in a copy of the project, with
params.yaml's settings but tracking off and the workers given by `--nproc`. The step time is the
median over the repeats of each run's measured median step (results/breakdown/<mode>.json, the
rank slowest at each step), beside the whole epoch's mean step; the state is each mode's largest
rank's, in MiB (results/train/<mode>.json); and, from the breakdown's slowest rank, each step's
communication: ddp's all-reduce, fsdp's all-gathers and reduce-scatters, and how much of it the
step waited for (exposed). Beside them, the scaling model's prediction for each (pipeline/scaling.py,
from commcheck's link: `mnist-pipeline commcheck` runs once first, as in `dvc repro`), and its error.

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/fsdp_step.py [--repeats 3] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import prepared_copy  # noqa: E402

from pipeline import scaling  # noqa: E402

MODES = ("ddp", "fsdp")


def train(project: Path, mode: str) -> dict:
    subprocess.run(["mnist-pipeline", "train", "--mode", mode], cwd=project, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((project / "results/train" / f"{mode}.json").read_text())
    breakdown = json.loads((project / "results/breakdown" / f"{mode}.json").read_text())
    slowest = scaling.slowest_rank(breakdown)
    kinds = (slowest or {}).get("collectives") or {}
    predicted = scaling.predict(breakdown, scaling.measured_link(breakdown["link"]) if breakdown.get("link") else None)
    return {"step_ms": 1000 * slowest["median_s"]["step"] if slowest else None,
            "comm_ms": ms(slowest["median_s"]["comm"]) if slowest else None,  # None: not measured (a GPU's fsdp)
            "exposed_ms": ms(slowest["median_s"]["comm_exposed"]) if slowest else None,
            "all_gather_ms": 1000 * kinds["all_gather"]["median_s"] if kinds else None,
            "reduce_scatter_ms": 1000 * kinds["reduce_scatter"]["median_s"] if kinds else None,
            "predicted_ms": 1000 * predicted["predicted_step_s"] if predicted else None,
            "error_pct": 100 * predicted["prediction_error"] if predicted and predicted["prediction_error"] is not None
            else None,
            "mean_step_ms": 1000 * summary["steady_step_s"] if summary.get("steady_step_s") else None,
            "state_mb": summary["state_mb_per_rank"], "world": summary["world_size"]}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def cell(key: str, value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}" if key == "error_pct" else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--train-limit", type=int, default=12000, help="data.train_limit: images an epoch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as tmp:
        project = prepared_copy(Path(tmp), args.train_limit, {"modes": list(MODES), "nproc": args.nproc, "epochs": 1})
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:  # alternating: a drift hits both
                runs[mode].append(train(project, mode))
    keys = ("step_ms", "mean_step_ms", "state_mb", "comm_ms", "exposed_ms", "all_gather_ms", "reduce_scatter_ms",
            "predicted_ms", "error_pct")
    columns = (("comm_ms", "comm ms", 8), ("exposed_ms", "exposed ms", 10), ("all_gather_ms", "all-gathers ms", 14),
               ("reduce_scatter_ms", "reduce-scatters ms", 18), ("predicted_ms", "predicted ms", 12),
               ("error_pct", "error %", 8))
    print(f"{'mode':<6} {'ranks':>5} {'median step ms':>15} {'mean step ms':>13} {'state MiB/rank':>15} "
          + " ".join(f"{title:>{width}}" for _, title, width in columns))
    row = {}
    for mode in MODES:
        row[mode] = {key: statistics.median(values) if (values := [r[key] for r in runs[mode] if r[key] is not None])
                     else None for key in keys}
        cells = " ".join(f"{cell(key, row[mode][key]):>{width}}" for key, _, width in columns)
        print(f"{mode:<6} {runs[mode][0]['world']:>5} {row[mode]['step_ms']:>15.2f} {row[mode]['mean_step_ms']:>13.2f} "
              f"{row[mode]['state_mb']:>15.4f} {cells}")
    print(f"fsdp / ddp: step {row['fsdp']['step_ms'] / row['ddp']['step_ms']:.2f}x, "
          f"state per rank {row['fsdp']['state_mb'] / row['ddp']['state_mb']:.2f}x "
          f"(median of {args.repeats} trainings each, alternating)")


if __name__ == "__main__":
    main()
