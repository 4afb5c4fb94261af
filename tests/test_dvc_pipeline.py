"""`dvc repro` of the whole pipeline on a small slice, in a temporary git repo."""

import json

import pytest

from tests.conftest import SMALL, make_project, project_env, run

MODES = ("single", "dp", "ddp")


@pytest.fixture(scope="module")
def repro(tmp_path_factory, mnist_dir):
    project = make_project(tmp_path_factory.mktemp("dvc") / "proj", SMALL)
    env = project_env(project, MNIST_SOURCE=str(mnist_dir))
    result = run(["dvc", "repro"], project, **env)
    return project, env, result


def test_repro_runs_every_stage(repro):
    project, _, result = repro
    for stage in ["prepare", *(f"train@{m}" for m in MODES)]:
        assert f"Running stage '{stage}'" in result.stdout
    for mode in MODES:
        assert (project / "models" / mode / "model.pt").is_file()
        summary = json.loads((project / "metrics/train" / f"{mode}.json").read_text())
        assert summary["mode"] == mode and summary["epochs"] == 2
        rows = (project / "plots/train" / f"{mode}.csv").read_text().splitlines()
        assert rows[0].startswith("epoch,train_loss") and len(rows) == 3


def test_second_repro_is_a_noop(repro):
    project, env, _ = repro
    again = run(["dvc", "repro"], project, **env)
    assert "Running stage" not in again.stdout


def test_each_stage_depends_only_on_the_params_it_reads(repro):
    project, env, _ = repro
    params = project / "params.yaml"
    original = params.read_text()
    try:
        params.write_text(original.replace("lr: 0.01", "lr: 0.02"))
        changed = json.loads(run(["dvc", "status", "--json"], project, **env).stdout)
        assert set(changed) == {f"train@{m}" for m in MODES}
    finally:
        params.write_text(original)
