"""The whole pipeline on all of real MNIST with the default params.yaml (about 2 minutes on 2 cores)."""

import json

import pytest

from tests.conftest import make_project, project_env, run

# dp on the CPU is the bare module (pipeline/parallel.py, wrap): the same computation as single, bit for bit
# (tests/test_train_modes.py: test_dp_on_cpu_is_the_bare_module_and_matches_single), so its accuracy
# is single's. Trained here it would add a third of this test's time and nothing it could catch.
MODES = ("single", "ddp")


@pytest.mark.slow
def test_every_mode_reaches_99_percent_and_they_agree(tmp_path, mnist_dir):
    project = make_project(tmp_path / "full", {"train": {"modes": list(MODES)}})
    run(["dvc", "repro"], project, **project_env(project, MNIST_SOURCE=str(mnist_dir)))
    accuracy = {m: json.loads((project / "results/eval" / f"{m}.json").read_text())["accuracy"] for m in MODES}
    print("test accuracy per mode:", accuracy)
    assert min(accuracy.values()) >= 0.990
    assert max(accuracy.values()) - min(accuracy.values()) <= 0.003
