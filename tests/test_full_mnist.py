"""The whole pipeline on all of real MNIST with the default params.yaml (about 2 minutes on 2 cores)."""

import json

import pytest

from tests.conftest import make_project, project_env, run

MODES = ("single", "dp", "ddp")


@pytest.mark.slow
def test_every_mode_reaches_99_percent_and_they_agree(tmp_path, mnist_dir):
    project = make_project(tmp_path / "full")
    run(["dvc", "repro"], project, **project_env(project, MNIST_SOURCE=str(mnist_dir)))
    accuracy = {m: json.loads((project / "results/eval" / f"{m}.json").read_text())["accuracy"] for m in MODES}
    print("test accuracy per mode:", accuracy)
    assert min(accuracy.values()) >= 0.990
    assert max(accuracy.values()) - min(accuracy.values()) <= 0.003
