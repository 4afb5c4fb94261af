"""`mnist-pipeline sweep`: the grid, its checks against params.yaml, and the refusals that submit
nothing. The sweep on a real Slurm cluster is in tests/test_multinode.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from pipeline import sweep
from pipeline.errors import ConfigError
from tests.conftest import ROOT, VENV_BIN, run, subprocess_env

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`

RAW = yaml.safe_load((ROOT / "params.yaml").read_text())


def test_the_grid_crosses_every_key_with_every_other_in_the_order_given():
    found = sweep.experiments(RAW, ["train.lr=0.01,0.03", "train.epochs=1,2", "train.optimizer=sgd"], "lr")
    assert [e.name for e in found] == ["lr-1", "lr-2", "lr-3", "lr-4"]
    assert [e.overrides for e in found] == [
        ("train.lr=0.01", "train.epochs=1", "train.optimizer=sgd"), ("train.lr=0.01", "train.epochs=2", "train.optimizer=sgd"),
        ("train.lr=0.03", "train.epochs=1", "train.optimizer=sgd"), ("train.lr=0.03", "train.epochs=2", "train.optimizer=sgd")]
    merged = sweep.apply(RAW, found[3].overrides, "params.yaml")
    assert (merged["train"]["lr"], merged["train"]["epochs"]) == (0.03, 2) and RAW["train"]["lr"] != 0.03  # a copy
    nested = sweep.apply(RAW, ("workload.init_args.model=classic",), "params.yaml")
    assert nested["workload"]["init_args"]["model"] == "classic"


@pytest.mark.parametrize("options, says", [
    ([], "nothing to sweep: give at least one -S KEY=V1,V2"),
    (["train.lr"], "expected KEY=VALUE or KEY=V1,V2"),
    (["train.lr=0.1,"], "an empty value"),
    (["train.lr=0.1", "train.lr=0.2"], "-S train.lr is given twice"),
    (["train.learning_rate=0.1,0.2"], "params.yaml has no key 'train.learning_rate'"),
    (["train.epochs=1,two"], "train.epochs = 'two' has the wrong type; allowed: an integer"),
    (["train.optimizer=adam,lion"], "train.optimizer = 'lion' is not allowed"),
])
def test_a_grid_params_yaml_refuses_is_one_line_naming_the_override(options, says):
    with pytest.raises(ConfigError) as refused:
        sweep.experiments(RAW, options, "grid")
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["a..b", "x.lock", "-x", "a/b", "n" * 101])
def test_a_name_that_makes_no_git_ref_is_refused(name):
    with pytest.raises(ConfigError, match="as a DVC experiment's name"):
        sweep.experiments(RAW, ["train.lr=0.1"], name)


@pytest.mark.parametrize("written, queued, state", [
    (None, "PENDING", "queued"),
    ({"state": "running"}, "RUNNING", "running"),
    (None, "RUNNING", "running"),  # started, not yet written
    ({"state": "done"}, None, "done"),
    ({"state": "failed"}, None, "failed"),
    ({"state": "running"}, None, "failed"),  # gone from the queue without a word: killed, or its node failed
    (None, None, "failed"),
    ({"state": "running"}, "CANCELLED", "failed"),
])
def test_an_experiments_state_from_its_file_and_slurms_queue(written, queued, state):
    assert sweep.state(written, queued) == state


@pytest.fixture
def project(tmp_path) -> Path:
    """A git repository with the project's params.yaml and a remote the sweep could push to."""
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (folder / "deploy/kubernetes").mkdir(parents=True)
    shutil.copy(ROOT / "deploy/kubernetes/sweep-trainjob.yaml", folder / "deploy/kubernetes")
    run(["git", "init", "-q", "-b", "main"], folder)
    run(["git", "add", "params.yaml", "deploy"], folder)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "params"], folder)
    run(["git", "init", "-q", "--bare", str(tmp_path / "remote.git")], tmp_path)
    run(["git", "remote", "add", "origin", str(tmp_path / "remote.git")], folder)
    return folder


def sweep_cli(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mnist-pipeline", "sweep", *args], cwd=project, capture_output=True, text=True,
                          env=subprocess_env(**env))


UNTRACKED = ["-S", "tracking.enabled=false"]  # no tracking server needed for the checks after it


@pytest.mark.parametrize("case, args, says", [
    ("", ["-S", "train.lr=0.1,x"], "train.lr = 'x' has the wrong type"),
    ("", ["-S", "train.nodes=2"], "each experiment of a sweep runs in one job on one node"),
    ("", ["-S", "train.lr=0.1,0.2"], "the tracking store is sqlite:///"),
    ("dirty", [*UNTRACKED, "-S", "train.lr=0.1,0.2"], "uncommitted changes (M params.yaml ...)"),
    ("no remote", [*UNTRACKED, "-S", "train.lr=0.1,0.2"], "no git remote 'origin' here"),
    ("gone remote", [*UNTRACKED, "-S", "train.lr=0.1,0.2"], "git remote 'origin' ("),
    ("no sbatch", [*UNTRACKED, "-S", "train.lr=0.1,0.2"], "sbatch is not on PATH"),
    ("no sbatch", [*UNTRACKED, "-S", "train.device=cpu", "--on", "kubernetes", "-S", "train.lr=0.1,0.2"],
     "kubectl is not on PATH"),
    ("", ["--name", "a b", "-S", "train.lr=0.1,0.2"], "--name 'a b': use up to 100 letters, digits"),
])
def test_bad_input_submits_nothing_and_says_why_in_one_line(project, tmp_path, case, args, says):
    env = {}
    if case == "dirty":
        (project / "params.yaml").write_text((project / "params.yaml").read_text() + "\n")
    elif case == "no remote":
        run(["git", "remote", "remove", "origin"], project)
    elif case == "gone remote":
        run(["git", "remote", "set-url", "origin", str(tmp_path / "gone.git")], project)
    elif case == "no sbatch":
        tools = tmp_path / "bin"  # git, and no Slurm
        tools.mkdir()
        (tools / "git").symlink_to(shutil.which("git"))
        env["PATH"] = f"{VENV_BIN}:{tools}"
    refused = sweep_cli(project, *args, **env)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and says in lines[0], refused.stderr
    assert not (project / ".sweeps").exists()
    assert "refs/sweeps" not in run(["git", "ls-remote", str(tmp_path / "remote.git")], tmp_path).stdout


def test_on_kubernetes_each_experiment_is_a_trainjob_of_its_own_valid_against_trainers_crd(project, tmp_path):
    """`--manifests-only`: one TrainJob per experiment, each valid against Trainer's CRD schema and
    Pod Security "restricted", its parameters in it (SWEEP_TASK), its resources the largest
    experiment's; the commit on the remote under the sweep's ref."""
    from tests.test_deploy import patched_pod, restricted_violations, trainjob_schema

    on_cpu = ["-S", "train.device=cpu", "-S", "train.nproc=2"]
    refused = sweep_cli(project, *UNTRACKED, "--on", "kubernetes", "--manifests-only", "-S", "train.lr=0.01,0.02")
    assert refused.returncode == 1 and "a pod sees only the GPUs it asks for" in refused.stderr, refused.stderr
    made = sweep_cli(project, *UNTRACKED, *on_cpu, "--on", "kubernetes", "--manifests-only", "-S", "train.lr=0.01,0.02",
                     "-S", "train.cpus_per_rank=1,3", "--name", "k8s")
    assert made.returncode == 0 and "written as TrainJobs: `kubectl apply -f" in made.stdout, made.stderr
    (folder,) = (project / ".sweeps").iterdir()
    jobs = list(yaml.safe_load_all((folder / "trainjobs.yaml").read_text()))
    schema = trainjob_schema()
    tasks = []
    for number, job in enumerate(jobs, start=1):
        jsonschema.validate(job, schema)
        assert not restricted_violations(patched_pod(job)), restricted_violations(patched_pod(job))
        assert job["metadata"]["name"] == f"mnist-sweep-{folder.name}-{number}" and len(job["metadata"]["name"]) <= 63
        assert job["metadata"]["labels"] == {"mnist-pipeline/sweep": folder.name}
        assert yaml.safe_load((folder / f"{job['metadata']['name']}.yaml").read_text()) == job  # a rerun's file
        (task,) = [e["value"] for e in job["spec"]["trainer"]["env"] if e["name"] == "SWEEP_TASK"]
        tasks.append(json.loads(task))
        asked = job["spec"]["trainer"]["resourcesPerNode"]  # the largest experiment's: 2 workers x 3 CPUs, 8 GB each
        assert asked == {"requests": {"cpu": "6", "memory": "16384Mi"}, "limits": {"memory": "24576Mi"}}, asked
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in job["spec"]["trainer"]["env"]  # no GPU asked
    fixed = ["tracking.enabled=false", "train.device=cpu", "train.nproc=2"]
    assert [t["experiments"][0]["overrides"] for t in tasks] == [
        [*fixed, "train.lr=0.01", "train.cpus_per_rank=1"], [*fixed, "train.lr=0.01", "train.cpus_per_rank=3"],
        [*fixed, "train.lr=0.02", "train.cpus_per_rank=1"], [*fixed, "train.lr=0.02", "train.cpus_per_rank=3"]]
    commit = run(["git", "rev-parse", "HEAD"], project).stdout.strip()
    assert {t["commit"] for t in tasks} == {commit}
    assert f"{commit}\trefs/sweeps/{folder.name}" in run(["git", "ls-remote", str(tmp_path / "remote.git")], tmp_path).stdout


def condition(kind: str, status: str) -> dict:
    return {"type": kind, "status": status, "reason": kind, "message": "", "lastTransitionTime": "2026-12-07T12:00:00Z"}


@pytest.mark.parametrize("conditions, state", [
    ([], "running"),
    ([condition("Suspended", "True")], "queued"),
    ([condition("Created", "True")], "running"),
    ([condition("Created", "True"), condition("Complete", "True")], "done"),
    ([condition("Created", "True"), condition("Failed", "True")], "failed"),
    ([condition("Suspended", "False"), condition("Complete", "False")], "running"),
    ([condition("Created", "False")], "failed"),  # its JobSet could not be made
])
def test_a_trainjobs_state_from_the_conditions_trainer_sets(conditions, state):
    """Conditions as Trainer's CRD defines them (Suspended, Created, Complete, Failed: its
    v1alpha1 constants), checked against the CRD's schema for the status."""
    from stages import sweep_kubernetes
    from tests.test_deploy import manifests, trainjob_schema

    job = {**manifests()["TrainJob"], "status": {"conditions": conditions}}
    jsonschema.validate(job, trainjob_schema())
    assert sweep_kubernetes.state_of(job) == state
    assert sweep_kubernetes.state_of(None) == "failed"  # deleted before it finished
