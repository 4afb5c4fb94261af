"""Where the first epoch loses its time: each step of the first epoch against the same step of the second.

first_epoch.py times whole epochs and found the first one slower. This script says where in the
epoch a difference sits and what it is made of. Each setting runs in a fresh process, the settings
in turn:
- loop, glibc defaults: only the pipeline's own epoch (`pipeline.loop.run_epoch`, with the model,
  optimizer and schedule of `build()`), twice, on the prepared training split, with the C
  allocator as a Python process starts with it;
- loop, freed memory kept: the same after `pipeline.malloc.keep_freed_memory()`;
- train command: `mnist-pipeline train --mode single` as the pipeline runs it (which calls it).
All use params.yaml's settings with 2 epochs and tracking off, single mode on the CPU, all of MNIST.
Each step's time comes from the loop's own clock (`StepClock`); each epoch's page faults and
system CPU time from getrusage. A difference in the first steps only is warm-up (the first call of
each kernel); a difference spread over the whole epoch has another cause. #13 asks for a first
epoch at most 10% slower than the second, or a measured reason why not.

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/step_times.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_overhead import copy_project  # noqa: E402

SETTINGS = ("loop, glibc defaults", "loop, freed memory kept", "train command")
# Slices of the epoch, as (first step, last step) counted from 1; None: to the end.
SLICES = ((1, 1), (2, 10), (11, 50), (51, None), (1, None))
RESULT = "epochs: "  # the line a worker prints its result on


def step_seconds(marks: dict[int, list[float]]) -> list[float]:
    """Each step's time from the CPU clock's marks (step -> its stamps, the first at its start)."""
    stamps = [marks[step] for step in sorted(marks)]
    starts = [step[0] for step in stamps]
    return [b - a for a, b in zip(starts, starts[1:])] + [stamps[-1][-1] - starts[-1]]


def recording_epochs(epochs: list[dict]) -> None:
    """From now on, each epoch the loop runs adds its step times, page faults and system CPU
    seconds to `epochs`."""
    import resource

    from pipeline import loop

    run_epoch = loop.run_epoch

    def recorded(*args, probe, **kwargs):
        before = resource.getrusage(resource.RUSAGE_SELF)
        result = run_epoch(*args, probe=probe, **kwargs)
        after = resource.getrusage(resource.RUSAGE_SELF)
        epochs.append({"steps": step_seconds(probe.clock.marks),
                       "faults": after.ru_minflt + after.ru_majflt - before.ru_minflt - before.ru_majflt,
                       "system_s": after.ru_stime - before.ru_stime})
        return result

    loop.run_epoch = recorded  # the train command's loop calls it through the module too


def loop_alone(project: Path) -> None:
    """Two epochs of the pipeline's loop, and nothing else, in this process."""
    import torch

    from pipeline import loop
    from pipeline.breakdown import Probe
    from pipeline.config import load_config
    from pipeline.parallel import Rank
    from pipeline.prepared import load_prepared
    from pipeline.workloads import load_workload

    full = load_config(project / "params.yaml")
    config, workload = full.train, load_workload(full.workload)
    device, rank = torch.device("cpu"), Rank()
    data = load_prepared(project / "data" / "prepared", ("train",))
    train = loop.to_device(data.splits["train"], data.mean, data.std, device)
    steps = config.epochs * loop.steps_per_epoch(len(train), config.batch_size)
    model, optimizer, scheduler = loop.build(config, steps, device, workload)
    wrapped = loop.wrap_for_mode(model, config, device, "single")
    for epoch in range(config.epochs):
        probe = Probe(device)
        loop.run_epoch(wrapped, optimizer, scheduler, train, loop.epoch_order(len(train), epoch, config.seed),
                       config.batch_size, rank, probe=probe, show_bar=False, desc="", workload=workload,
                       max_grad_norm=config.max_grad_norm, grad_accum_steps=config.grad_accum_steps)
        probe.clock.totals()


def train_command(project: Path) -> None:
    """`mnist-pipeline train --mode single` in this process."""
    from stages.cli import main

    os.chdir(project)
    main(["train", "--mode", "single"], standalone_mode=False)


def worker(setting: str, project: Path) -> None:
    epochs: list[dict] = []
    recording_epochs(epochs)
    if setting == "train command":
        train_command(project)
    else:
        if setting == "loop, freed memory kept":
            from pipeline.malloc import keep_freed_memory

            if not keep_freed_memory():
                sys.exit("this C library has no mallopt (not glibc): nothing to compare")
        loop_alone(project)
    print(RESULT + json.dumps(epochs), flush=True)


def slice_sum(times: list[float], first: int, last: int | None) -> float:
    return sum(times[first - 1 : last])


def describe(first: int, last: int | None) -> str:
    if (first, last) == (1, None):
        return "whole epoch"
    if first == last:
        return f"step {first}"
    return f"steps {first}-{last}" if last else f"steps {first}-end"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per setting; the median counts")
    parser.add_argument("--worker", nargs=2, metavar=("SETTING", "PROJECT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return

    source = Path(os.environ.get("MNIST_SOURCE", Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
    env = {**os.environ, "MNIST_SOURCE": str(source.resolve())}
    env.pop("MLFLOW_TRACKING_URI", None)
    runs: dict[str, list[list[dict]]] = {setting: [] for setting in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="step-times-") as tmp:
        project = copy_project(Path(tmp))
        env["PYTHONPATH"] = str(project)
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["train"]["epochs"] = 2
        params["tracking"]["enabled"] = False
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        subprocess.run([sys.executable, "-m", "stages", "prepare"], cwd=project, env=env, check=True,
                       capture_output=True)
        for repeat in range(args.repeats):
            turn = repeat % len(SETTINGS)  # the first one changes every repeat
            for setting in SETTINGS[turn:] + SETTINGS[:turn]:
                done = subprocess.run([sys.executable, __file__, "--worker", setting, str(project)], env=env,
                                      check=True, capture_output=True, text=True)
                result = next(line for line in done.stdout.splitlines() if line.startswith(RESULT))
                runs[setting].append(json.loads(result.removeprefix(RESULT)))
                first, second = (sum(epoch["steps"]) for epoch in runs[setting][-1])
                print(f"{setting}: first epoch {first:.1f} s, second {second:.1f} s", flush=True)

    def median(got: list[list[dict]], value) -> tuple[float, float]:
        return tuple(statistics.median(value(epochs[i]) for epochs in got) for i in (0, 1))

    steps = len(runs[SETTINGS[0]][0][0]["steps"])
    print(f"\nEach step of the first epoch against the same step of the second: single mode, {steps} steps an "
          f"epoch, a fresh process each (medians of {args.repeats})\n")
    print("| setting | steps | first epoch, s | second epoch, s | first - second, s | first / second |")
    print("|---|---|---:|---:|---:|---:|")
    for setting, got in runs.items():
        for first_step, last_step in SLICES:
            a, b = median(got, lambda epoch: slice_sum(epoch["steps"], first_step, last_step))
            ratio = statistics.median(slice_sum(first["steps"], first_step, last_step)
                                      / slice_sum(second["steps"], first_step, last_step) for first, second in got)
            print(f"| {setting} | {describe(first_step, last_step)} | {a:.2f} | {b:.2f} | {a - b:+.2f} | {ratio:.2f} |")
    print("\nWhat the process asked of the kernel in each epoch\n")
    print("| setting | page faults, first epoch | second epoch | system CPU, s, first epoch | second epoch |")
    print("|---|---:|---:|---:|---:|")
    for setting, got in runs.items():
        faults, system = median(got, lambda epoch: epoch["faults"]), median(got, lambda epoch: epoch["system_s"])
        print(f"| {setting} | {faults[0]:,.0f} | {faults[1]:,.0f} | {system[0]:.2f} | {system[1]:.2f} |")

if __name__ == "__main__":
    main()
