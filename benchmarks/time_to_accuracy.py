"""Time to 99%: the earlier default recipe against params.yaml's, on the same seeds, side by side.

Each recipe trains single mode (one process, every core) from scratch on all of MNIST's training
split (the prepare stage's 55,000/5,000 split) for each seed, then scores the 10,000 test images.
The recipes run interleaved, seed by seed, so a slow spell of a shared machine hits both. What
counts: the median training time of each (the loop's `train_time_s`), their ratio (#13's target: at
most 0.5), and the lowest test accuracy over the seeds (target: at least 99.0% on every one).

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/time_to_accuracy.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import malloc, parallel  # noqa: E402
from pipeline.config import WorkloadConfig, load_config  # noqa: E402
from pipeline.workloads import load_workload  # noqa: E402
from pipeline.loop import Training, evaluate, to_device, train  # noqa: E402

import mnist_data  # noqa: E402  (benchmarks/, this script's folder)

# The default before #13: what "today's recipe" means in the issue.
EARLIER = {"epochs": 2, "batch_size": 128, "optimizer": "adam", "schedule": "onecycle", "lr": 0.01, "weight_decay": 0.0}
EARLIER_WORKLOAD = WorkloadConfig(init_args={"model": "small", "label_smoothing": 0.0})


def run_once(config, workload: WorkloadConfig, data: dict, out: Path) -> tuple[float, float, float]:
    """(training seconds, first epoch's seconds over the second's, test accuracy)."""
    device = torch.device("cpu")
    model, history = train(Training(config, "single", parallel.Rank(), device, out, workload=workload),
                           data["train"], data["val"])
    sums = evaluate(model, data["test"], torch.arange(len(data["test"])), config.eval_batch_size,
                    workload=load_workload(workload))
    warmup = history[0]["epoch_time_s"] / history[1]["epoch_time_s"] if len(history) > 1 else float("nan")
    return sum(m["train_time_s"] for m in history), warmup, (sums["accuracy"] / sums["count"]).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="train.seed = 1..N for each recipe")
    parser.add_argument("--params", default=str(ROOT / "params.yaml"))
    args = parser.parse_args()
    malloc.keep_freed_memory()  # as in every mnist-pipeline process (stages/cli.py)
    config = load_config(args.params)
    splits, mean, std = mnist_data.splits(config.data)
    data = {name: to_device(split, mean, std, torch.device("cpu")) for name, split in splits.items()}
    torch.set_num_threads(parallel.available_cpus())

    recipes = {"earlier": (replace(config.train, **EARLIER), EARLIER_WORKLOAD),
               "params.yaml": (config.train, config.workload)}
    results: dict[str, list[tuple[int, float, float, float]]] = {name: [] for name in recipes}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(1, args.seeds + 1):
            for name, (recipe, workload) in recipes.items():
                seconds, warmup, accuracy = run_once(replace(recipe, seed=seed), workload, data, Path(tmp) / name)
                results[name].append((seed, seconds, warmup, accuracy))
                print(f"{name} seed {seed}: {seconds:.1f} s, test accuracy {accuracy:.2%}", flush=True)

    print(f"\nTime to accuracy, single mode on {parallel.available_cpus()} CPU cores, seeds 1-{args.seeds}\n")
    print("| recipe | model | epochs | batch | lr | label smoothing | median training time, s "
          "| first / second epoch | lowest test accuracy | median test accuracy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (recipe, workload) in recipes.items():
        rows = results[name]
        warmups = [w for _, _, w, _ in rows if w == w]  # NaN for a one-epoch recipe
        args = workload.init_args
        cells = [name, args.get("model"), recipe.epochs, recipe.batch_size, f"{recipe.lr:g}", f"{args.get('label_smoothing'):g}",
                 f"{statistics.median(s for _, s, _, _ in rows):.1f}",
                 f"{statistics.median(warmups):.2f}" if warmups else "one epoch",
                 f"{min(a for *_, a in rows):.2%}", f"{statistics.median(a for *_, a in rows):.2%}"]
        print("| " + " | ".join(map(str, cells)) + " |")
    earlier, new = (statistics.median(s for _, s, _, _ in results[n]) for n in recipes)
    print(f"\nparams.yaml / earlier training time: {new / earlier:.2f} (target at most 0.5); "
          f"lowest test accuracy of params.yaml's recipe: {min(a for *_, a in results['params.yaml']):.2%} "
          "(target at least 99.0%)")


if __name__ == "__main__":
    main()
