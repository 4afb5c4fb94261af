"""A sweep's TrainJob run as its pod would run it: the container's command and env from the
manifest `sweep --on kubernetes` wrote (the ConfigMap and Secrets resolved as the kubelet does),
here rather than in a cluster. The experiment's parameters come from the TrainJob alone."""

from __future__ import annotations

import json
import subprocess

import yaml

from tests.conftest import SMALL, make_project, run, subprocess_env


def test_a_trainjobs_pod_runs_its_experiment_and_pushes_it_to_the_remote(tmp_path, mnist_dir):
    project = make_project(tmp_path / "proj", {**SMALL, "commcheck": {"enabled": False}, "tracking": {"enabled": False},
                                               "train": {**SMALL["train"], "modes": ["single"], "epochs": 1}})
    remote = tmp_path / "remote.git"
    run(["git", "init", "-q", "--bare", str(remote)], tmp_path)
    run(["git", "remote", "add", "origin", str(remote)], project)
    made = run(["mnist-pipeline", "sweep", "--on", "kubernetes", "--manifests-only", "-S", "train.device=cpu",
                "-S", "train.lr=0.01,0.005", "--name", "pod"], project, PYTHONPATH=str(project))
    (folder,) = (project / ".sweeps").iterdir()
    job = next(yaml.safe_load_all((folder / "trainjobs.yaml").read_text()))  # pod-1: train.lr=0.01
    trainer = job["spec"]["trainer"]
    config_map = {"MLFLOW_TRACKING_URI": "http://unused.invalid:5000"}  # tracking is off in this sweep
    secrets = {"mlflow-credentials": {"username": "u", "password": "p"}}

    def resolve(entry: dict) -> str | None:
        if "value" in entry:
            return entry["value"]
        ref = entry["valueFrom"].get("configMapKeyRef") or entry["valueFrom"]["secretKeyRef"]
        found = (config_map if "configMapKeyRef" in entry["valueFrom"] else secrets.get(ref["name"], {})).get(ref["key"])
        assert found is not None or ref.get("optional"), entry
        return found

    env = {e["name"]: value for e in trainer["env"] if (value := resolve(e)) is not None}
    scratch = tmp_path / "scratch"  # the pod's emptyDir
    scratch.mkdir()
    env["SWEEP_SCRATCH"] = str(scratch)
    pod = tmp_path / "pod"  # the container's working directory: the image's, not the submitting checkout
    pod.mkdir()
    ran = subprocess.run(trainer["command"], cwd=pod, capture_output=True, text=True,
                         env=subprocess_env(**env, MNIST_SOURCE=str(mnist_dir)))
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "sweep" in made.stdout and "pod-1: done, pushed to origin" in ran.stderr, ran.stderr[-2000:]
    refs = run(["git", "ls-remote", str(remote), "refs/exps/*"], tmp_path).stdout.split()
    (experiment,) = [sha for sha, ref in zip(refs[::2], refs[1::2]) if ref.endswith("/pod-1")]
    params = yaml.safe_load(run(["git", "--git-dir", str(remote), "show", f"{experiment}:params.yaml"], tmp_path).stdout)
    assert params["train"]["lr"] == 0.01  # from the TrainJob, not the image
    results = json.loads(run(["git", "--git-dir", str(remote), "show", f"{experiment}:metrics/single.json"],
                             tmp_path).stdout)
    assert results  # the experiment ran to its end: compare's metrics are in what it pushed
    assert not list(scratch.iterdir())  # the pod's checkout, removed once pushed
