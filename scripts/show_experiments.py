"""`make show`: every experiment DVC knows, one row per mode, with what a person compares.

`dvc exp show` lists every param and metric (one column per mode and key, far wider than a
terminal); this reads its JSON and keeps six params that shape a training, every other param whose
value differs between the rows shown (what a sweep swept: `-S train.weight_decay=...` gets a
column), and the numbers that answer "which mode, and what did it buy" (its test scores: a column
for each metric the workload's evaluation gave, accuracy first, else its loss; the speed-up with its
95% interval, and how many things compare warned of). `make show ARGS=-A` passes arguments to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata

MODES = ("single", "dp", "ddp", "fsdp")  # pipeline.config's order; this script runs without the package
PARAMS = ("workload.init_args.model", "train.epochs", "train.batch_size", "train.lr", "train.nproc", "train.device")
COLUMNS = (("samples_per_s", "samples/s", "{:,.0f}"),  # after the warm-up where every mode has one (compare's)
           ("speedup", "speed-up (95%)", "{:.2f}x"), ("train_time_s", "train time", "{:.1f} s"),
           ("timing_warnings", "warnings", "{:.0f}"))  # what compare warned of (reports/comparison.md says)
# compare's own numbers in metrics/<mode>.json (pipeline.report.mode_metrics); the others there are
# the workload's test scores.
OWN = {"accuracy", "loss", "val_accuracy", "val_loss", "samples_per_s", "train_time_s", "timing_warnings",
       *(f"{key}{end}" for key in ("speedup", "scaling_efficiency", "step_ms") for end in ("", "_low", "_high"))}


def scores(metrics: list[dict]) -> list[str]:
    """The test scores a table of these modes' metrics shows: every number the workloads'
    evaluations gave (accuracy first, the others by name), else the loss."""
    names = {key for numbers in metrics for key, value in numbers.items()
             if key not in OWN and isinstance(value, (int, float))}
    if any(isinstance(numbers.get("accuracy"), (int, float)) for numbers in metrics):
        names.add("accuracy")
    return sorted(names, key=lambda name: (name != "accuracy", name)) or ["loss"]


def score(numbers: dict, name: str) -> str:
    value = numbers.get(name)
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.2%}" if name == "accuracy" else f"{value:.4g}"


def cell(numbers: dict, key: str, fmt: str) -> str:
    """A metric as `make show` prints it, with its 95% interval where compare gave one."""
    value, low, high = (numbers.get(name) for name in (key, f"{key}_low", f"{key}_high"))
    if not isinstance(value, (int, float)):
        return "-"
    interval = isinstance(low, (int, float)) and isinstance(high, (int, float))
    return fmt.format(value) + (f" ({low:.2f}-{high:.2f})" if interval else "")


def rows(shown: list[dict]) -> list[dict]:
    """(experiment, its params and metrics) for the workspace, each commit and its experiments."""
    found = []
    for commit in shown:
        entries = [(commit["rev"] if commit["rev"] == "workspace" else commit.get("name") or commit["rev"][:7],
                    commit.get("data") or {})]
        for experiment in commit.get("experiments") or []:
            for rev in experiment.get("revs") or []:
                entries.append((f"  {experiment.get('name') or rev['rev'][:7]}", rev.get("data") or {}))
        for name, data in entries:
            params = (data.get("params") or {}).get("params.yaml", {}).get("data", {})
            metrics = {path: value.get("data", {}) for path, value in (data.get("metrics") or {}).items()}
            found.append({"name": name, "params": params, "metrics": metrics})
    return found


# Where a commit from before a key moved kept it: the model was train's before workloads were named.
FORMERLY = {"workload.init_args.model": "train.model"}


def param(params: dict, dotted: str) -> str:
    for name in (dotted, FORMERLY.get(dotted)):
        value = params
        for key in (name or "").split("."):
            value = value.get(key, {}) if isinstance(value, dict) else {}
        if value != {}:
            return str(value)
    return "-"


def dotted_keys(params: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in params.items():
        keys += dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def shown_params(found: list[dict]) -> list[str]:
    """The six (MNIST's model where a row has one: another workload's rows have none), then each
    other param whose value is not the same in every row that has params, in params.yaml's order."""
    with_params = [entry["params"] for entry in found if entry["params"]]
    keys = dict.fromkeys(key for params in with_params for key in dotted_keys(params))
    fixed = [key for key in PARAMS if key != PARAMS[0] or any(param(params, key) != "-" for params in with_params)]
    differing = [key for key in keys if key not in PARAMS
                 and len({param(params, key) for params in with_params}) > 1]
    return [*fixed, *differing]


def label(dotted: str) -> str:
    return dotted.split(".", 1)[1] if dotted.startswith("train.") else dotted


def display_width(text: str) -> int:
    """Columns a terminal gives `text`: two for wide and fullwidth characters (CJK), none for
    combining marks, one otherwise; len() counts code points."""
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
               for ch in text)


def padded(text: str, width: int, right: bool) -> str:
    fill = " " * max(0, width - display_width(text))
    return fill + text if right else text + fill


def by_mode(entry: dict) -> list[tuple[str, dict]]:
    """An entry's modes in pipeline.config's order, with their numbers: metrics/<mode>.json only
    (revisions from before it had other files: metrics/train/...)."""
    found = {path[len("metrics/"):-len(".json")]: numbers for path, numbers in entry["metrics"].items()
             if path in {f"metrics/{mode}.json" for mode in MODES}}
    return sorted(found.items(), key=lambda item: MODES.index(item[0]))


def table(found: list[dict]) -> str:
    shown = shown_params(found)
    names = scores([numbers for entry in found for _, numbers in by_mode(entry)])
    header = ["experiment", *(label(p) for p in shown), "mode", *(f"test {name}" for name in names),
              *(title for _, title, _ in COLUMNS)]
    lines = []
    for entry in found:
        settings = [param(entry["params"], p) for p in shown]
        for i, (mode, numbers) in enumerate(by_mode(entry) or [("-", {})]):
            cells = [entry["name"] if i == 0 else "", *(settings if i == 0 else [""] * len(settings)), mode]
            cells += [*(score(numbers, name) for name in names), *(cell(numbers, key, fmt) for key, _, fmt in COLUMNS)]
            lines.append(cells)
    widths = [max(display_width(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    text = [" ".join(padded(str(cell), w, right=i > len(shown) + 1)
                     for i, (cell, w) in enumerate(zip(row, widths))) for row in [header, *lines]]
    return "\n".join(line.rstrip() for line in text)


def main(args: list[str]) -> int:
    proc = subprocess.run(["dvc", "exp", "show", "--json", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return proc.returncode
    print(table(rows(json.loads(proc.stdout))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
