"""Where the time of a whole `dvc repro` goes: the training loops against everything else.

Each repeat copies the project (the files git sees) into a new folder with its own git repository,
runs `dvc repro` there from a clean state with the default params.yaml on all of MNIST, and reads
the time of every line the pipeline prints. A stage's wall time runs from its "Running stage" line
to the next one; for a train stage, the time from its start to its first step is its first epoch
line's time less that epoch's time (plots/train/<mode>.csv), and the time from its last step to its
exit runs from its last epoch line to the next stage. The ratio that matters is the whole repro's
wall time over the sum of the three training loops (`train_time_s`), #13's fixed-cost target
being at most 1.4. Then it times what each kind of process the pipeline starts pays for its imports
before any work, and adds them up in the order `dvc repro` starts them: the part of the fixed cost
no change short of fewer processes (or lighter libraries) can remove.

With `--against REV`, each repeat also runs the pipeline of an earlier commit (its files as git
has them at REV, run with this project's virtual environment), the two in turn, and it prints both
fixed costs: whether a change made the pipeline cheaper, measured on the same machine in the same
hour rather than against a number from another day.

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/pipeline_overhead.py [--repeats 3] [--against REV]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE_LINE = re.compile(r"^Running stage '([^']+)':")
EPOCH_LINE = re.compile(r"^(single|dp|ddp) epoch (\d+)/(\d+):")


def copy_project(dest: Path, rev: str | None = None) -> Path:
    """The project's files (the working tree as git sees it, or commit `rev`) in `dest`, in a fresh
    git repository of their own, without the outputs of any earlier run."""
    if rev:
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    else:
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split("\0")
        for name in filter(None, files):
            if (ROOT / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, dest / name)
    # Clean state: no outputs, and no dvc.lock that could let DVC skip a stage.
    for generated in ("metrics", "results", "plots", "reports", "checks", "dvc.lock"):
        target = dest / generated
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "benchmark copy"]):
        subprocess.run(git + command, cwd=dest, check=True)
    return dest


def timed_repro(project: Path, env: dict) -> tuple[float, list[tuple[float, str]]]:
    """(wall seconds, [(seconds since start, line)]) of one `dvc repro`."""
    started = time.perf_counter()
    proc = subprocess.Popen(["dvc", "repro"], cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = [(time.perf_counter() - started, line.rstrip("\n")) for line in proc.stdout]
    if proc.wait() != 0:
        sys.exit("dvc repro failed:\n" + "\n".join(line for _, line in lines[-40:]))
    return time.perf_counter() - started, lines


def breakdown(project: Path, wall: float, lines: list[tuple[float, str]]) -> dict:
    """Per stage: wall time and, for train stages, loop time, start-up and tear-down."""
    starts = [(t, STAGE_LINE.match(line)[1]) for t, line in lines if STAGE_LINE.match(line)]
    stages = {}
    for (start, name), (end, _) in zip(starts, starts[1:] + [(wall, "")]):
        row = {"wall_s": end - start}
        epochs = [(t, m) for t, line in lines if start <= t < end and (m := EPOCH_LINE.match(line))]
        if name.startswith("train@") and epochs:
            mode = name.split("@")[1]
            with (project / "plots/train" / f"{mode}.csv").open() as handle:
                first_epoch_s = float(next(csv.DictReader(handle))["epoch_time_s"])
            loop = json.loads((project / "results/train" / f"{mode}.json").read_text())["train_time_s"]
            row.update(loop_s=loop, startup_s=epochs[0][0] - start - first_epoch_s, teardown_s=end - epochs[-1][0])
        stages[name] = row
    loops = sum(row.get("loop_s", 0.0) for row in stages.values())
    return {"wall_s": wall, "loops_s": loops, "ratio": wall / loops, "stages": stages}


TORCH = "import torch"
STORE = "import mlflow.store.tracking.sqlalchemy_store"  # MLflow and its local sqlite:/// store
# torch.optim's optimizers import torch._dynamo on first use (their methods are wrapped in
# torch._disable_dynamo): every training process pays it, compiled or not.
OPTIMIZER = "torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])"
PLOTS = "import matplotlib.pyplot"
# What each kind of process a `dvc repro` starts imports before it does any work.
PROCESS_KINDS = {
    "python alone": "pass",
    "torch: prepare, and the launchers of commcheck and ddp": TORCH,
    "torch + MLflow: a commcheck worker": f"{TORCH}; {STORE}",
    "torch + MLflow + a first optimizer: a training (single, dp, a ddp worker)": f"{TORCH}; {STORE}; {OPTIMIZER}",
    "torch + MLflow + matplotlib: evaluate": f"{TORCH}; {STORE}; {PLOTS}",
    "MLflow + matplotlib: compare": f"{STORE}; {PLOTS}",
}
# The processes of one `dvc repro`, one after another. A stage's workers start together and import
# side by side, each on a core of its own here, so they count once.
SEQUENCE = [  # (process, kind)
    ("prepare", 1), ("commcheck launcher", 1), ("commcheck workers", 2), ("train@single", 3), ("train@dp", 3),
    ("train@ddp launcher", 1), ("train@ddp workers", 3), ("evaluate", 4), ("compare", 5)]


def import_costs(repeats: int) -> dict[str, float]:
    """Median seconds of a fresh process that imports what each kind of process imports."""
    costs = {}
    for label, statement in PROCESS_KINDS.items():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", statement], check=True)
            times.append(time.perf_counter() - started)
        costs[label] = statistics.median(times)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="whole runs; the medians count")
    parser.add_argument("--against", metavar="REV", help="also run this commit's pipeline, in turn with this one")
    args = parser.parse_args()
    if args.against and subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.against}^{{commit}}"],
                                       cwd=ROOT, stdout=subprocess.DEVNULL).returncode != 0:
        sys.exit(f"--against {args.against}: no such commit in {ROOT}")  # now, not after the first run
    source = Path(os.environ.get("MNIST_SOURCE", ROOT.parent / "shared" / "data" / "mnist")).resolve()
    env = {**os.environ, "MNIST_SOURCE": str(source), "DVC_NO_ANALYTICS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)  # each copy's own SQLite store, as `make run` has
    results: dict[str | None, list[dict]] = {None: []} | ({args.against: []} if args.against else {})
    for repeat in range(args.repeats):
        # In turn, the first one changing every repeat: a busier minute falls on both alike.
        for rev in list(results)[repeat % len(results):] + list(results)[:repeat % len(results)]:
            with tempfile.TemporaryDirectory(prefix="pipeline-overhead-") as tmp:
                project = copy_project(Path(tmp), rev)
                env["PYTHONPATH"] = str(project)
                results[rev].append(breakdown(project, *timed_repro(project, env)))
            got = results[rev][-1]
            print(f"run {repeat + 1}{f' ({rev})' if rev else ''}: {got['wall_s']:.1f} s, loops {got['loops_s']:.1f} s",
                  flush=True)
    runs = results[None]

    def median(get) -> float:
        return statistics.median(get(run) for run in runs)

    print(f"\nWhere a whole `dvc repro` goes (default params, all of MNIST; medians of {args.repeats})\n")
    print("| stage | wall, s | training loop, s | start to first step, s | last step to exit, s |")
    print("|---|---:|---:|---:|---:|")
    for name in runs[0]["stages"]:
        row = runs[0]["stages"][name]
        cells = [median(lambda r: r["stages"][name]["wall_s"])]
        cells += [median(lambda r: r["stages"][name][key]) if key in row else None
                  for key in ("loop_s", "startup_s", "teardown_s")]
        print(f"| {name} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
    wall, loops = median(lambda r: r["wall_s"]), median(lambda r: r["loops_s"])
    print(f"\nwhole dvc repro {wall:.1f} s, training loops {loops:.1f} s, "
          f"everything else {median(lambda r: r['wall_s'] - r['loops_s']):.1f} s")
    print(f"fixed cost: wall / loops = {median(lambda r: r['ratio']):.2f} (target at most 1.4)")
    if args.against:
        print(f"\nThis tree against {args.against}, the same repeats in turn (medians of {args.repeats})\n")
        print("| code | whole dvc repro, s | training loops, s | everything else, s | wall / loops |")
        print("|---|---:|---:|---:|---:|")
        fixed = {rev: statistics.median(r["wall_s"] - r["loops_s"] for r in got) for rev, got in results.items()}
        for rev, got in results.items():
            wall_s, loops_s, ratio = (statistics.median(r[key] for r in got) for key in ("wall_s", "loops_s", "ratio"))
            print(f"| {rev or 'this tree'} | {wall_s:.1f} | {loops_s:.1f} | {fixed[rev]:.1f} | {ratio:.2f} |")
        print(f"\neverything else, this tree / {args.against}: {fixed[None] / fixed[args.against]:.2f}")

    print(f"\nWhat a process pays to start, before any work (a fresh process each, median of {args.repeats})\n")
    print("| process | seconds |")
    print("|---|---:|")
    costs = import_costs(args.repeats)
    for label, seconds in costs.items():
        print(f"| {label} | {seconds:.2f} |")
    labels = list(PROCESS_KINDS)
    if {process.split()[0] for process, _ in SEQUENCE} != set(runs[0]["stages"]):
        sys.exit(f"SEQUENCE names other stages than dvc repro ran ({', '.join(runs[0]['stages'])}): update it")
    floor = sum(costs[labels[kind]] for _, kind in SEQUENCE)
    print(f"\nimports alone, process after process as dvc repro starts them ({len(SEQUENCE)} in a row): "
          f"{floor:.1f} s; with the loops, the lowest wall / loops these processes allow here: "
          f"{(loops + floor) / loops:.2f}")

if __name__ == "__main__":
    main()
