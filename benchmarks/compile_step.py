"""What `train.compile` buys and costs, side by side in one run (#56): each mode's step time eager
and compiled, and the compile's cost in the first epoch.

Each mode trains one epoch through the stage (`mnist-pipeline train --mode M`) in a copy of the
project, with params.yaml's settings but tracking off, eager and compiled in turn (the order
alternating between repeats, so a drift hits both), `--repeats` times each. Per training: the
steady-state step (results/train/<mode>.json: the steps after train.throughput_warmup_steps, in
which the compile happens), and the whole epoch's time (compile included). Medians over the
repeats; the ratios are compiled / eager. TorchInductor's compiled kernels are cached on disk
(/tmp/torchinductor_$USER) after the first compile, so the first repeat's compile costs more than
the later ones': the first-epoch column is the median.

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/compile_step.py [--repeats 3] \
        [--modes single ddp fsdp] [--model small|classic] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import prepared_copy  # noqa: E402


def train(project: Path, mode: str, compiled: bool) -> dict:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["compile"] = compiled
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["mnist-pipeline", "train", "--mode", mode], cwd=project, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((project / "results/train" / f"{mode}.json").read_text())
    return {"step_ms": 1000 * summary["steady_step_s"], "epoch_s": summary["train_time_s"],
            "world": summary["world_size"], "val_accuracy": summary["val_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["single", "ddp", "fsdp"])
    parser.add_argument("--model", default="small", help="MNIST's workload.init_args.model: small | classic")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--train-limit", type=int, default=12000, help="data.train_limit: images an epoch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="compile-bench-") as tmp:
        project = prepared_copy(Path(tmp), args.train_limit, {"modes": args.modes, "nproc": args.nproc, "epochs": 1},
                                {"model": args.model})
        runs = {(mode, compiled): [] for mode in args.modes for compiled in (False, True)}
        for repeat in range(args.repeats):
            for mode in args.modes:
                for compiled in (False, True) if repeat % 2 == 0 else (True, False):
                    runs[mode, compiled].append(train(project, mode, compiled))
    print(f"{args.model} model, {args.train_limit} images, median of {args.repeats} trainings each, alternating")
    print(f"{'mode':<6} {'ranks':>5} {'eager step ms':>14} {'compiled step ms':>17} {'step':>6} "
          f"{'eager epoch s':>14} {'compiled epoch s':>17} {'val acc eager/compiled':>23}")
    for mode in args.modes:
        eager, compiled = ({key: statistics.median(r[key] for r in runs[mode, c]) for key in ("step_ms", "epoch_s")}
                           for c in (False, True))
        accuracy = "/".join(f"{runs[mode, c][0]['val_accuracy']:.4f}" for c in (False, True))
        print(f"{mode:<6} {runs[mode, False][0]['world']:>5} {eager['step_ms']:>14.2f} {compiled['step_ms']:>17.2f} "
              f"{compiled['step_ms'] / eager['step_ms']:>5.2f}x {eager['epoch_s']:>14.2f} {compiled['epoch_s']:>17.2f} "
              f"{accuracy:>23}")


if __name__ == "__main__":
    main()
