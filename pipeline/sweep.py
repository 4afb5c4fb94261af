"""A sweep: a grid of `-S KEY=V1,V2` overrides as named DVC experiments, each run where the compute
is (stages/sweep.py submits them), and what the submitting machine keeps of it: one record per sweep
in `.sweeps/<id>/sweep.json`, and one state file per experiment that its job writes
(`.sweeps/<id>/<name>.json`: running, then done or failed). No process waits on the login node:
`sweep status` reads these files and Slurm's queue.

Nothing here submits or runs: the grid, its checks against params.yaml's types, and the state an
experiment is in, as plain functions.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import config_from_dict, missing_keys
from pipeline.errors import ConfigError

SWEEPS_DIR = Path(".sweeps")  # in the project, which the nodes share: git-ignored
STATES = ("queued", "running", "done", "failed")
# A DVC experiment's name is a git ref's last part: letters, digits, and - _ . inside.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_NAME = 100


@dataclass(frozen=True)
class Experiment:
    name: str
    overrides: tuple[str, ...]  # KEY=VALUE, each as `dvc exp run -S` takes it

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "overrides": list(self.overrides)}


def grid(options: list[str]) -> list[tuple[str, ...]]:
    """`-S KEY=V1,V2` options, each KEY's values crossed with every other KEY's (as `dvc exp run
    --queue -S` makes its grid): one tuple of KEY=VALUE per experiment, in the order given."""
    axes: dict[str, list[str]] = {}
    for option in options:
        key, sep, values = option.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ConfigError(f"sweep: -S {option!r}: expected KEY=VALUE or KEY=V1,V2,... (e.g. -S train.lr=0.01,0.02)")
        if key in axes:
            raise ConfigError(f"sweep: -S {key} is given twice; list its values in one: -S {key}=V1,V2")
        axes[key] = [value.strip() for value in values.split(",")]
        if "" in axes[key]:
            raise ConfigError(f"sweep: -S {option!r}: an empty value; list the values as V1,V2")
    if not axes:
        raise ConfigError("sweep: nothing to sweep: give at least one -S KEY=V1,V2 (e.g. -S train.lr=0.01,0.02)")
    return [tuple(f"{key}={value}" for key, value in zip(axes, values)) for values in itertools.product(*axes.values())]


def apply(raw: dict, overrides: tuple[str, ...], source: str) -> dict:
    """params.yaml's mapping with each KEY=VALUE set (the value read as YAML, as DVC reads `-S`),
    checked as every stage checks params.yaml: a key it does not hold, or a value its type or rules
    refuse, is one line that names the override."""
    merged = copy.deepcopy(raw)
    for override in overrides:
        key, _, text = override.partition("=")
        *path, leaf = key.split(".")
        node = merged
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise ConfigError(f"sweep: -S {override}: {source} has no key {key!r}; a sweep changes keys it holds")
        try:
            node[leaf] = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"sweep: -S {override}: not a YAML value ({exc.problem})") from None
    try:
        config_from_dict(merged, source)
    except ConfigError as exc:
        raise ConfigError(f"sweep: -S {' -S '.join(overrides)}: {exc}") from None
    if missing := missing_keys(merged):
        raise ConfigError(f"sweep: {source}: missing key {missing[0]!r}; params.yaml must hold every knob")
    return merged


def experiments(raw: dict, options: list[str], prefix: str, source: str = "params.yaml") -> list[Experiment]:
    """The sweep's experiments, each checked against params.yaml, named PREFIX-1, PREFIX-2, ..."""
    # A git ref's last part (DVC's experiment refs): no "..", no ".lock" end, short enough for a file name.
    if not _NAME.fullmatch(prefix) or ".." in prefix or prefix.endswith((".", ".lock")) or len(prefix) > MAX_NAME:
        raise ConfigError(f"sweep: --name {prefix!r}: use up to {MAX_NAME} letters, digits and - _ . (no '..'), "
                          "as a DVC experiment's name")
    found = []
    for number, overrides in enumerate(grid(options), start=1):
        apply(raw, overrides, source)
        found.append(Experiment(f"{prefix}-{number}", overrides))
    return found


def state(written: dict | None, in_queue: str | None) -> str:
    """An experiment's state, from the file its job writes (None: not yet) and what Slurm's queue
    says of its job (None: not there). A job gone from the queue that never wrote `done` or
    `failed` was killed, or its node failed: failed too."""
    if written and written.get("state") in ("done", "failed"):
        return written["state"]
    if in_queue in ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING"):
        return "queued"
    if in_queue is not None and in_queue not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                 "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"):
        return "running"
    return "failed"
