"""The pipeline's fixed cost: what a whole `dvc repro` spends outside its training loops, in units
of one bare `python -c "import torch"` (#25: at most 12).

Each repeat copies the project (the files git sees) into a new folder with its own git repository,
times three bare torch imports (their median is the repeat's unit, so the figure means the same on
a slow machine and a fast one), then runs `dvc repro` there from a clean state with the default
params.yaml on all of MNIST. Everything but the three loops' `train_time_s` is the fixed cost.

Per stage it splits the time three ways. A stage's wall time runs from its "Running stage" line to
the next one. The stage's command is timed by a stand-in `mnist-pipeline` first on PATH, which
notes when it starts and ends and runs the real one: the rest of the stage's wall time is DVC's own
(hashing, lock file, starting the command). Inside a train stage, the loop is `train_time_s`, and
the time from the command's start to its first step is its first epoch line's time less that
epoch's time (plots/train/<mode>.csv).

Then it times what each kind of process the pipeline starts pays for its imports before any work,
and adds up what each stage imports on its critical path (CRITICAL_PATH): the floor of this design
before any work is done (`--imports-only` prints just that). Under DVC every stage but prepare is
a fork of one warm server (pipeline/runtime/warm.py): the server's imports are paid once, beside prepare.

With `--against REV`, each repeat also runs the pipeline of an earlier commit (its files as git
has them at REV, run with this project's virtual environment), the two in turn, and it prints both
fixed costs: whether a change made the pipeline cheaper, measured on the same machine in the same
hour rather than against a number from another day.

With `--stand-in-driver`, each repeat also runs this tree on a host with an NVIDIA driver: the
stand-in `libcuda.so.1` and `libnvidia-ml.so.1` (tests/stand_in_libcuda.c, built with gcc) on
LD_LIBRARY_PATH, which `import torch` loads as it loads a real one, while the CUDA runtime finds no
device. With `--no-server`, also with every stage in a process of its own (MNIST_PIPELINE_WARM=0):
what the warm server saves.

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/pipeline_overhead.py [--repeats 3] \
        [--against REV] [--stand-in-driver] [--no-server]
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


def prepared_copy(dest: Path, train_limit: int, train: dict, workload_args: dict | None = None) -> Path:
    """copy_project with params.yaml's settings but `train_limit` images, `train`'s and the
    workload's `workload_args` changes and tracking off, prepared and commchecked (the link the
    scaling model predicts from), as `dvc repro` would before its trainings."""
    import yaml

    if os.environ.get("MNIST_SOURCE"):  # read from the copy's folder: a relative path would miss
        os.environ["MNIST_SOURCE"] = str(Path(os.environ["MNIST_SOURCE"]).resolve())
    project = copy_project(dest)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["data"]["train_limit"] = train_limit
    params["workload"]["init_args"].update(workload_args or {})
    params["train"].update(train)
    params["tracking"]["enabled"] = False
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for stage in ("prepare", "commcheck"):
        subprocess.run(["mnist-pipeline", stage], cwd=project, check=True, stdout=subprocess.DEVNULL)
    return project


GOAL_UNITS = 12
# Stands in for `mnist-pipeline` on PATH: notes when each command starts and ends (DVC runs every
# stage's command through a shell, so this is the command as DVC starts it). It runs the copy's own
# entry point, `python -m pipeline`: the venv's `mnist-pipeline` script names this tree's, which an
# earlier commit (--against) may not have.
SHIM = """#!/bin/sh
echo "start $(date +%s.%N) $*" >> "$PIPELINE_TIMES"
"$PIPELINE_PYTHON" -m pipeline "$@"
code=$?
echo "end $(date +%s.%N)" >> "$PIPELINE_TIMES"
exit $code
"""


def torch_unit(repeats: int = 3) -> float:
    """The median wall time of a fresh `python -c "import torch"`: the unit of the fixed cost."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def timed_repro(project: Path, env: dict) -> tuple[float, list[tuple[float, str]], list[tuple[float, float]]]:
    """(wall seconds, [(seconds since start, line)], [(start, end) of each command]) of one `dvc repro`."""
    shim_dir = project / ".bench-bin"
    shim_dir.mkdir()
    (shim_dir / "mnist-pipeline").write_text(SHIM)
    (shim_dir / "mnist-pipeline").chmod(0o755)
    times_file = project / ".bench-times"
    env = {**env, "PATH": f"{shim_dir}{os.pathsep}{env['PATH']}", "PIPELINE_TIMES": str(times_file),
           "PIPELINE_PYTHON": sys.executable}
    epoch_zero, started = time.time(), time.perf_counter()
    proc = subprocess.Popen(["dvc", "repro"], cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = [(time.perf_counter() - started, line.rstrip("\n")) for line in proc.stdout]
    if proc.wait() != 0:
        sys.exit("dvc repro failed:\n" + "\n".join(line for _, line in lines[-40:]))
    wall = time.perf_counter() - started
    marks = [line.split() for line in times_file.read_text().splitlines()]
    commands, begun = [], None
    for mark in marks:
        if mark[0] == "start":
            begun = float(mark[1]) - epoch_zero
        else:
            commands.append((begun, float(mark[1]) - epoch_zero))
    return wall, lines, commands


def breakdown(project: Path, unit: float, wall: float, lines: list[tuple[float, str]],
              commands: list[tuple[float, float]]) -> dict:
    """Per stage: wall time, its command's, DVC's own and, for train stages, the loop, start-up
    and tear-down."""
    starts = [(t, STAGE_LINE.match(line)[1]) for t, line in lines if STAGE_LINE.match(line)]
    # Before the first stage: DVC reads the project, checks it and hashes the stages' inputs.
    stages = {"(dvc, before the first stage)": {"wall_s": starts[0][0], "command_s": 0.0, "dvc_s": starts[0][0],
                                                 "fixed_units": starts[0][0] / unit}}
    for (start, name), (end, _) in zip(starts, starts[1:] + [(wall, "")]):
        mine = [(a, b) for a, b in commands if start - 0.5 <= a < end]  # DVC prints its line, then starts it
        command = sum(b - a for a, b in mine)
        row = {"wall_s": end - start, "command_s": command, "dvc_s": end - start - command}
        epochs = [(t, m) for t, line in lines if start <= t < end and (m := EPOCH_LINE.match(line))]
        if name.startswith("train@") and epochs:
            mode = name.split("@")[1]
            with (project / "plots/train" / f"{mode}.csv").open() as handle:
                first_epoch_s = float(next(csv.DictReader(handle))["epoch_time_s"])
            loop = json.loads((project / "results/train" / f"{mode}.json").read_text())["train_time_s"]
            begun = mine[0][0] if mine else start
            row.update(loop_s=loop, startup_s=epochs[0][0] - begun - first_epoch_s,
                       teardown_s=(mine[-1][1] if mine else end) - epochs[-1][0])
        row["fixed_units"] = (row["wall_s"] - row.get("loop_s", 0.0)) / unit
        stages[name] = row
    loops = sum(row.get("loop_s", 0.0) for row in stages.values())
    return {"unit_s": unit, "wall_s": wall, "loops_s": loops, "fixed_s": wall - loops,
            "units": (wall - loops) / unit, "stages": stages}


TORCH = "import torch"
STORE = "import mlflow.store.tracking.sqlalchemy_store"  # MLflow and its local sqlite:/// store
# torch.optim's optimizers import torch._dynamo on first use (their methods are wrapped in
# torch._disable_dynamo), and so does torch.use_deterministic_algorithms (torch._inductor.config).
DYNAMO = "import torch._dynamo"
PLOTS = "import matplotlib.pyplot"
# What each kind of process a `dvc repro` starts imports before it does any work.
PROCESS_KINDS = {
    "python alone": "pass",
    "a stage's client (pipeline.runtime.warm)": "import pipeline.runtime.warm",
    "torch (the unit)": TORCH,
    "torch + torch._dynamo": f"{TORCH}; {DYNAMO}",
    "MLflow with its SQL store": STORE,
    "torch + MLflow": f"{TORCH}; {STORE}",
    "torch + MLflow + torch._dynamo: a training": f"{TORCH}; {STORE}; {DYNAMO}",
    "matplotlib": PLOTS,
    "torch + matplotlib": f"{TORCH}; {PLOTS}",
    "the warm server: everything a stage imports": "from pipeline.runtime.warm_server import preload; from stages.entry import WARM_APP; "
                                                   "assert preload(WARM_APP['preload']) is None",
    "dvc.repo": "import dvc.repo",
}


# What each stage imports on its critical path in this design, before any work. prepare runs in a
# process of its own (torch) while the warm server imports everything beside it; commcheck waits
# for the server; every later stage is a client, and its command a fork of the server.
CRITICAL_PATH = {
    "prepare": "torch (the unit)",
    "commcheck": "the warm server: everything a stage imports",  # less what prepare took meanwhile
    "train@single": "a stage's client (pipeline.runtime.warm)",
    "train@dp": "a stage's client (pipeline.runtime.warm)",
    "train@ddp": "a stage's client (pipeline.runtime.warm)",
    "evaluate": "a stage's client (pipeline.runtime.warm)",
    "compare": "a stage's client (pipeline.runtime.warm)",
}


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


def print_import_costs(repeats: int) -> None:
    print(f"\nWhat a process pays to start, before any work (a fresh process each, median of {repeats})\n")
    print("| process imports | seconds | units |")
    print("|---|---:|---:|")
    costs = import_costs(repeats)
    unit = costs["torch (the unit)"]
    for label, seconds in costs.items():
        print(f"| {label} | {seconds:.2f} | {seconds / unit:.2f} |")
    # prepare's torch runs beside the server's imports, so the server's alone is on the path.
    paths = {stage: costs[kind] for stage, kind in CRITICAL_PATH.items()}
    floor = (sum(paths.values()) - paths["prepare"]) / unit
    print(f"\nimports on the stages' critical paths in this design ({', '.join(CRITICAL_PATH)}): "
          f"{floor:.1f} units (prepare's torch beside the warm server's imports), before any work and "
          "before DVC's own time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="whole runs; the medians count")
    parser.add_argument("--against", metavar="REV", help="also run this commit's pipeline, in turn with this one")
    parser.add_argument("--imports-only", action="store_true", help="only the import costs, no dvc repro")
    parser.add_argument("--stand-in-driver", action="store_true", help="also on a host with the stand-in NVIDIA driver")
    parser.add_argument("--no-server", action="store_true", help="also with every stage in a process of its own")
    args = parser.parse_args()
    if args.imports_only:
        print_import_costs(args.repeats)
        return
    if args.against and subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.against}^{{commit}}"],
                                       cwd=ROOT, stdout=subprocess.DEVNULL).returncode != 0:
        sys.exit(f"--against {args.against}: no such commit in {ROOT}")  # now, not after the first run
    source = Path(os.environ.get("MNIST_SOURCE", ROOT.parent / "shared" / "data" / "mnist")).resolve()
    env = {**os.environ, "MNIST_SOURCE": str(source), "DVC_NO_ANALYTICS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)  # each copy's own SQLite store, as `make run` has
    driver = Path(tempfile.mkdtemp(prefix="stand-in-driver-")) if args.stand_in_driver else None
    # Each arm: (label, the commit whose files run (None: this tree), what its environment adds).
    arms = [("this tree", None, {})]
    if driver:
        arms.append(("this tree, stand-in driver", None, {"LD_LIBRARY_PATH": str(build_stand_in_driver(driver))}))
    if args.no_server:
        arms.append(("this tree, no warm server", None, {"MNIST_PIPELINE_WARM": "0"}))
    if args.against:
        arms.append((args.against, args.against, {}))
    results: dict[str, list[dict]] = {label: [] for label, _, _ in arms}
    for repeat in range(args.repeats):
        # In turn, the first one changing every repeat: a busier minute falls on every arm alike.
        for label, rev, extra in arms[repeat % len(arms):] + arms[:repeat % len(arms)]:
            with tempfile.TemporaryDirectory(prefix="pipeline-overhead-") as tmp:
                project = copy_project(Path(tmp), rev)
                unit = torch_unit()
                results[label].append(breakdown(project, unit, *timed_repro(project, {**env, **extra,
                                                                                      "PYTHONPATH": str(project)})))
            got = results[label][-1]
            print(f"run {repeat + 1} ({label}): {got['wall_s']:.1f} s, loops {got['loops_s']:.1f} s, "
                  f"fixed {got['fixed_s']:.1f} s = {got['units']:.1f} x {unit:.2f} s (import torch)", flush=True)
    if driver:
        shutil.rmtree(driver)
    runs = results["this tree"]

    def median(get, of=runs) -> float:
        return statistics.median(get(run) for run in of)

    print(f"\nWhere a whole `dvc repro` goes (default params, all of MNIST; medians of {args.repeats}; "
          "units: one bare `import torch` of the same repeat)\n")
    print("| stage | wall, s | its command, s | DVC's own, s | training loop, s | start to first step, s "
          "| last step to exit, s | fixed cost, units |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in runs[0]["stages"]:
        row = runs[0]["stages"][name]
        keys = ("wall_s", "command_s", "dvc_s", "loop_s", "startup_s", "teardown_s", "fixed_units")
        cells = [median(lambda r: r["stages"][name][key]) if key in row else None for key in keys]
        print(f"| {name} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
    fixed_units = median(lambda r: r["units"])
    print(f"\nwhole dvc repro {median(lambda r: r['wall_s']):.1f} s, training loops {median(lambda r: r['loops_s']):.1f} s, "
          f"everything else {median(lambda r: r['fixed_s']):.1f} s; bare `import torch` {median(lambda r: r['unit_s']):.2f} s")
    print(f"fixed cost: {fixed_units:.1f} units (goal at most {GOAL_UNITS}: "
          f"{'met' if fixed_units <= GOAL_UNITS else 'not met'})")
    if len(arms) > 1:
        print(f"\nEach arm, the same repeats in turn (medians of {args.repeats})\n")
        print("| code | whole dvc repro, s | training loops, s | everything else, s | import torch, s | fixed cost, units "
              "| against this tree |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for label, got in results.items():
            cells = [median(lambda r: r[key], got) for key in ("wall_s", "loops_s", "fixed_s", "unit_s", "units")]
            ratio = median(lambda r: r["units"], got) / median(lambda r: r["units"])
            print(f"| {label} | " + " | ".join(f"{c:.2f}" if i == 3 else f"{c:.1f}" for i, c in enumerate(cells))
                  + f" | {ratio:.2f} |")

    print_import_costs(args.repeats)

def build_stand_in_driver(folder: Path) -> Path:
    """The stand-in NVIDIA driver's two libraries in `folder` (as tests/conftest.py builds them)."""
    for library in ("libcuda.so.1", "libnvidia-ml.so.1"):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / library), str(ROOT / "tests" / "stand_in_libcuda.c")],
                       check=True)
    return folder


if __name__ == "__main__":
    main()
