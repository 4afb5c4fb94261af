"""Every DVC stage lists, as deps, every project module its command imports: a stage whose code
changed but whose deps did not would be skipped by `dvc repro` with stale outputs."""

import ast
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`

PACKAGES = ("pipeline", "stages")
STAGE_MODULES = {"prepare": "stages.prepare", "commcheck": "stages.commcheck", "train": "stages.train",
                 "evaluate": "stages.evaluate", "compare": "stages.compare"}


def module_file(name: str) -> Path | None:
    for candidate in (ROOT / f"{name.replace('.', '/')}.py", ROOT / name.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_files(module: str, seen: set[Path] | None = None) -> set[Path]:
    """The project files `module` needs, following its imports (and each package's __init__)."""
    seen = set() if seen is None else seen
    path = module_file(module)
    if path is None or path in seen:
        return seen
    seen.add(path)
    parts = module.split(".")
    for i in range(1, len(parts)):
        imported_files(".".join(parts[:i]), seen)
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name.split(".")[0] in PACKAGES:
                imported_files(name, seen)
    return seen


@pytest.mark.parametrize("stage", STAGE_MODULES)
def test_stage_deps_cover_the_code_it_runs(stage):
    definition = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    deps = set(definition.get("do", definition)["deps"])
    # Every stage runs through the CLI, which sets up the process (the allocator) before dispatching.
    code = imported_files(STAGE_MODULES[stage]) | imported_files("stages.cli")
    if ROOT / "pipeline/workloads/__init__.py" in code:  # it imports the workload params.yaml names, by name
        class_path = yaml.safe_load((ROOT / "params.yaml").read_text())["workload"]["class_path"]
        code |= imported_files(class_path.rpartition(".")[0])
    # A stage that imports workloads may build the project's own, in workloads/: the folder is its dependency.
    builds = ROOT / "pipeline/workloads/__init__.py" in code
    assert ("workloads" in deps) == builds, f"{stage}: workloads/ {'missing from' if builds else 'in'} its deps"
    needed = {str(p.relative_to(ROOT)) for p in code}
    # The CLI's own dispatching, the warm server a stage runs in under DVC (pipeline/runtime/warm.py), the
    # processes it starts ahead (the fork server DDP workers are
    # forked from, the helper that makes evaluate's and compare's MLflow calls: how things start,
    # not what they compute), and the packages' __init__ files, which hold a docstring, the version
    # and MLflow's process settings (its log level, retries, telemetry): none of them changes what a
    # stage computes.
    needed -= {"stages/cli.py", "pipeline/runtime/warm.py", "pipeline/runtime/forkserver.py",
               "pipeline/tracking/helper.py", "pipeline/__init__.py", "pipeline/runtime/__init__.py",
               "pipeline/tracking/__init__.py", "stages/__init__.py"}
    assert sorted(needed - deps) == []
    # And nothing more: a module listed that the stage never imports would rerun it for an edit that
    # cannot change its outputs (the UI's links retraining every mode).
    listed_code = {dep for dep in deps if dep.startswith(PACKAGES) and dep.endswith(".py")}
    assert sorted(listed_code - needed) == []


def test_every_setting_a_training_follows_is_a_param_of_the_train_stage():
    """A checkpoint continues only under its trajectory's settings (pipeline.checkpoint): each is
    one DVC reruns the training for, or an edit would leave the last one's model standing."""
    from pipeline.checkpoint import TRAJECTORY_KEYS

    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]
    params = stage.get("do", stage)["params"]
    assert "workload" in params
    assert [f"train.{key}" for key in TRAJECTORY_KEYS if f"train.{key}" not in params] == []
