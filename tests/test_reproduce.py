"""`mnist-pipeline reproduce RUN_ID`: a mode's training re-made from its MLflow record alone, in a
temporary checkout of the recorded commit with its patch, logged to the same store; its verdict in
one line and its exit code (0 bit for bit, 1 differs, 2 refused), and the workspace untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from pipeline import record
from pipeline import reproduce as remake
from pipeline.config import MODES  # fsdp too: every mode is re-made
from pipeline.tracking.store import sqlite_uri
from tests.conftest import (REFUSE_CUDA, ROOT, SMALL, build_stand_in_driver, commit_notes, edit_notes, free_port,
                            make_project, prepare, project_env, run, scaled, subprocess_env, train_cli, write_tiny_mnist)

def gpus_here() -> int:
    import torch

    return torch.cuda.device_count()


GPUS_HERE = gpus_here()
STORE_FILES = ("mlflow.db", "mlflow.db-wal", "mlflow.db-shm", "mlartifacts")  # the store: it takes the new run


def client_of(project: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{project / 'mlflow.db'}")


def parent_of(project: Path, mode: str) -> str:
    return json.loads((project / "models" / mode / "mlflow_run.json").read_text())["parent"]


def workspace_state(project: Path) -> dict[str, tuple[int, int]]:
    """Every file of the workspace but the store's, with its size and modification time."""
    return {str(path.relative_to(project)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in project.rglob("*")
            if path.is_file() and path.relative_to(project).parts[0] not in (*STORE_FILES, ".git")}


def reproduce(project: Path, run_id: str, **env: str) -> subprocess.CompletedProcess:
    return run(["mnist-pipeline", "reproduce", run_id], project, check=False, **project_env(project, **env))


def verdict(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.startswith("reproduce: ")]
    return lines[-1] if lines else f"no verdict:\n{proc.stdout}\n{proc.stderr}"


REGISTERED = "mnist-small"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mnist_dir) -> Path:
    """A small project in which each mode trained once, from a clean tree, each registering its
    model under the mode's alias."""
    project = make_project(tmp_path_factory.mktemp("reproduce") / "proj",
                           {**SMALL, "tracking": {"registered_model": REGISTERED}})
    prepare(project, mnist_dir)
    for mode in MODES:
        train_cli(project, mode)
    return project


@pytest.mark.fast
def test_a_run_the_store_does_not_hold_is_refused_before_anything_is_made(tmp_path):
    """No training needed: the project's own store, made empty, holds no such run; the workspace
    is left as it was and nothing is checked out."""
    project = make_project(tmp_path / "proj", SMALL)
    before = workspace_state(project)
    proc = reproduce(project, "e" * 32)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"reproduce: run {'e' * 32}: no such run in the tracking store {sqlite_uri(project / 'mlflow.db')} (is "
        "MLFLOW_TRACKING_URI the store it was logged to?)"], proc.stderr
    assert workspace_state(project) == before and not list((project / ".dvc" / "tmp").glob("reproduce-*"))


def registry(client: MlflowClient) -> tuple[dict, dict]:
    """The registered model's versions (version: run) and the modes' aliases (mode: version)."""
    versions = {v.version: v.run_id for v in client.search_model_versions(f"name = '{REGISTERED}'")}
    aliases = client.get_registered_model(REGISTERED).aliases
    return versions, aliases


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_is_remade_bit_for_bit(trained, mode):
    """Each named by its run's id, and single by the mode's name, which names the workspace's last
    training of it, not the store's newest run of the mode (one reproduction holds both: each is a
    training). Re-making an old run leaves the registry alone: no version of its own, and the
    mode's alias still on the model the workspace trained.

    single's run is renamed first, as the MLflow UI lets anyone do: a training is known by its
    tags. And it is re-made under fewer threads than it had (OMP_NUM_THREADS here), which split
    each op's sums otherwise: the reproduction trains with the run's own. (Those two were a test of
    their own, whose reproduction cost another training's imports.)"""
    original = parent_of(trained, mode)
    client = client_of(trained)
    before_registry = registry(client)
    assert len(before_registry[0]) == len(MODES) and set(before_registry[1]) == set(MODES)
    tags = client.get_run(original).data.tags
    env = {}
    if mode == "single":  # a newer finished run of the mode in the store, which the name must not find
        decoy = client.create_run(client.get_run(original).info.experiment_id, run_name="single",
                                  tags={"mode": "single"}).info.run_id
        client.set_terminated(decoy, "FINISHED")
        assert tags["cpu_threads"] == str(torch_threads()) and tags["usable_cpus"].isdigit()
        client.set_tag(original, "mlflow.runName", "my best run")
        env = {"OMP_NUM_THREADS": "1"}
    before = workspace_state(trained)
    try:
        proc = reproduce(trained, mode if mode == "single" else original, **env)
    finally:
        if mode == "single":
            client.set_tag(original, "mlflow.runName", "single")
    assert proc.returncode == 0, verdict(proc)
    assert verdict(proc).startswith("reproduce: reproduced bit for bit"), verdict(proc)
    if mode == "single":
        assert f"as run {original} did" in proc.stdout
    assert workspace_state(trained) == before  # outputs, models/, the checkout: as they were
    assert registry(client) == before_registry
    tags = client.get_run(original).data.tags
    assert tags["reproduction"] == "bit for bit"
    remade = client.get_run(tags["reproduction_run"])
    assert remade.data.tags["reproduces"] == original and remade.info.status == "FINISHED"
    assert remade.info.run_name == mode and remade.info.experiment_id == client.get_run(original).info.experiment_id
    for key in ("world_size", "device_type", "code_sha256", "params_sha256", "data_sha256", "weights_sha256"):
        assert remade.data.tags[key] == tags[key], key
    if mode == "single":  # the run's threads, not the 1 it was started with
        assert remade.data.tags["cpu_threads"] == tags["cpu_threads"]
    if mode in ("ddp", "fsdp"):  # through its launcher: a run per rank again
        ranks = client.search_runs([remade.info.experiment_id], f"tags.mlflow.parentRunId = '{remade.info.run_id}'")
        assert sorted(r.info.run_name for r in ranks) == [f"{mode}/rank-0", f"{mode}/rank-1"]


def test_a_cpu_run_is_remade_on_a_gpu_host_whose_gpus_are_hidden_as_advised(trained, tmp_path):
    """reproduce's advice for a CPU run on a GPU host: hide the GPUs (CUDA_VISIBLE_DEVICES=). On the
    stand-in driver showing 2 GPUs, that re-makes the run on the CPU, bit for bit."""
    build_stand_in_driver(tmp_path)
    proc = reproduce(trained, parent_of(trained, "single"), LD_LIBRARY_PATH=str(tmp_path), STAND_IN_GPUS="2",
                     CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0 and verdict(proc).startswith("reproduce: reproduced bit for bit"), verdict(proc)
    assert "CUDA_VISIBLE_DEVICES='' hides the 2 GPU(s)" in proc.stdout + proc.stderr


def test_a_run_from_a_dirty_tree_is_remade_from_its_patch(tmp_path, mnist_dir):
    """The uncommitted change of tracked files goes with the parent run, exactly as `git apply`
    would re-make it, and the code digest is the dirty tree's. The change decides the weights (a
    narrower layer): without the patch, the reproduction could not match."""
    from tests.test_tracking import check_record, runs_of

    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "epochs": 1}})
    prepare(project, mnist_dir)
    commit_notes(project)
    edit_notes(project)  # bytes a text round trip would change: the patch must still apply
    model = project / "pipeline" / "model.py"
    model.write_text(model.read_text().replace("nn.Linear(32 * 7 * 7, 128)", "nn.Linear(32 * 7 * 7, 64)  ")
                     .replace("nn.Linear(128, 10),\n    )\n\n\ndef classic", "nn.Linear(64, 10),\n    )\n\n\ndef classic"))
    train_cli(project, "single")
    original = parent_of(project, "single")
    parent, children = runs_of(client_of(project), project, "single")
    assert parent.data.tags["git_dirty"] == "true" and parent.data.tags["git_patch"] == record.PATCH_ARTIFACT
    logged = Path(mlflow.artifacts.download_artifacts(run_id=original, artifact_path=record.PATCH_ARTIFACT,
                                                      tracking_uri=f"sqlite:///{project / 'mlflow.db'}"))
    expected = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=project, capture_output=True, check=True).stdout
    assert logged.read_bytes() == expected  # bytes: latin-1 and CRLF as they are
    assert b"nn.Linear(64, 10)" in expected and "Grüße".encode("latin-1") in expected and b"\r\n" in expected
    check_record(parent, children, project, "single")
    run(["git", "checkout", "--", "pipeline/model.py"], project)  # the workspace moves on
    # A user's git config that would change the bytes of the checkout (LF to CRLF) and of the patch
    # applied (its trailing spaces dropped), had the reproduction not overridden it.
    hostile = tmp_path / "gitconfig"
    hostile.write_text("[core]\n\tautocrlf = true\n[apply]\n\twhitespace = fix\n")
    proc = reproduce(project, original, GIT_CONFIG_GLOBAL=str(hostile))
    assert proc.returncode == 0, verdict(proc)
    remade = client_of(project).get_run(client_of(project).get_run(original).data.tags["reproduction_run"])
    assert remade.data.tags["git_dirty"] == "true"  # the checkout with the patch applied, as the original


def test_a_difference_is_named_with_what_differs_in_the_record(tmp_path):
    """The MNIST files the data is prepared from changed (the workspace's data with them): the
    reproduction prepares what the recorded params say from what it is given, and the verdict names
    the weights' difference and the data's digest."""
    first = write_tiny_mnist(tmp_path / "mnist-a")
    second = tmp_path / "mnist-b"
    second.mkdir()
    for path in first.iterdir():
        header = 16 if "images" in path.name else 8
        raw = path.read_bytes()
        body = bytes((b * 7 + 3) % 256 for b in raw[header:]) if "images" in path.name else raw[header:]
        (second / path.name).write_bytes(raw[:header] + body)
    params = {"data": {"verify_checksums": False, "val_size": 10, "train_limit": 0},
              "train": {"epochs": 1, "batch_size": 10, "nproc": 2}, "commcheck": SMALL["commcheck"]}
    project = make_project(tmp_path / "proj", params)
    run(["mnist-pipeline", "prepare"], project, **project_env(project, MNIST_SOURCE=str(first)))
    train_cli(project, "single")
    original = parent_of(project, "single")
    run(["mnist-pipeline", "prepare"], project, **project_env(project, MNIST_SOURCE=str(second)))
    proc = reproduce(project, original, MNIST_SOURCE=str(second))
    assert proc.returncode == 1, verdict(proc)
    line = verdict(proc)
    assert "largest |Δw|" in line and "data_sha256" in line and "code_sha256" not in line, line
    assert client_of(project).get_run(original).data.tags["reproduction"] == "differs"


@pytest.fixture(scope="module")
def records(trained) -> dict[str, str]:
    """Runs whose records a reproduction must refuse, each made as the store would hold it."""
    client = client_of(trained)
    good = client.get_run(parent_of(trained, "single"))
    experiment = good.info.experiment_id
    params = yaml.safe_dump(yaml.safe_load((trained / "params.yaml").read_text()))

    def made(name: str, status: str | None = "FINISHED", **tags: str) -> str:
        kept = {key: good.data.tags[key] for key in ("git_commit", "git_dirty", "code_sha256", "world_size",
                                                     "device_type", "mode")}
        run_id = client.create_run(experiment, run_name=name, tags={**kept, **tags}).info.run_id
        client.log_text(run_id, params, "params.yaml")
        if status:
            client.set_terminated(run_id, status)
        return run_id

    rank = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{good.info.run_id}'")[0].info.run_id
    return {"rank": rank,
            "commcheck": made("commcheck", mode="commcheck"),
            "failed": made("single", "FAILED"),
            "running": made("single", None),
            "no patch": made("single", git_dirty="true"),
            "unknown commit": made("single", git_commit="0123456789abcdef0123456789abcdef01234567"),
            "gpus": made("ddp", mode="ddp", device_type="cuda", world_size=str(GPUS_HERE + 1)),
            # In the self-contained image git sees no repository; the image recorded its source commit.
            "image": made("single", git_commit="unknown", git_dirty="unknown",
                          image_source_commit=good.data.tags["git_commit"]),
            "dirty image": made("single", git_commit="unknown", image_source_commit="0123abcd-dirty"),
            "described image": made("single", git_commit="unknown",  # `git describe` past a tag
                                    image_source_commit=f"v1.0-3-g{good.data.tags['git_commit']}"),
            "no model": made("single")}


@pytest.mark.parametrize("case, says", [
    ("rank", "one rank's run: reproduce the mode's run it belongs to"),
    ("commcheck", "not a training"),
    ("failed", "is FAILED: only a finished training"),
    ("running", "is RUNNING"),
    ("no patch", "kept no patch"),
    ("unknown commit", "is not in the repository"),
    ("gpus", f"trained on {GPUS_HERE + 1} CUDA device(s); this host has {GPUS_HERE}"),
    ("no model", "its logged model is not there"),
    ("image", "its logged model is not there"),  # past the commit: the image's is used
    ("described image", "its logged model is not there"),
    ("dirty image", "ran in an image built from a tree with uncommitted changes (0123abcd-dirty)"),
    ("unknown run", "no such run"),
    ("no store", "does not answer"),
])
def test_what_cannot_be_remade_is_refused_in_one_line(trained, records, case, says):
    run_id = records.get(case, "f" * 32)
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"} if case == "no store" else {}
    before = workspace_state(trained)
    proc = reproduce(trained, run_id, **env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reproduce: ") and says in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert workspace_state(trained) == before


def test_weights_digest_is_over_the_tensors_not_the_file(tmp_path):
    """The same weights saved twice (another pickle, another zip) have one digest; a flipped bit, a
    renamed tensor or another dtype do not."""
    import torch

    weights = {"a.weight": torch.randn(4, 3), "a.bias": torch.zeros(4), "steps": torch.tensor(7)}
    torch.save({"state_dict": weights}, tmp_path / "one.pt")
    torch.save({"state_dict": dict(reversed(weights.items())), "extra": [1, 2]}, tmp_path / "two.pt")
    assert (tmp_path / "one.pt").read_bytes() != (tmp_path / "two.pt").read_bytes()
    assert record.saved_weights_digest(tmp_path / "one.pt") == record.saved_weights_digest(tmp_path / "two.pt")
    digest = record.weights_digest(weights)
    flipped = {**weights, "a.bias": weights["a.bias"].clone()}
    flipped["a.bias"].view(torch.int32)[0] ^= 1
    assert record.weights_digest(flipped) != digest
    assert record.weights_digest({**{"b.bias" if k == "a.bias" else k: v for k, v in weights.items()}}) != digest
    assert record.weights_digest({**weights, "a.bias": weights["a.bias"].double()}) != digest


def test_the_devices_a_run_used_are_read_from_its_record():
    def used(mode, world, shares):
        return remake.devices_used(remake.Recorded("r", mode, {"world_size": world}, {"batch_shares": shares}, "", b""))

    assert used("ddp", "24", "6x8/5x16") == 24 and used("single", "1", "128") == 1
    assert used("fsdp", "3", "43/43/42") == 3
    assert used("dp", "1", "43/43/42") == 3 and used("dp", "1", "6x8/5x16") == 24


SOFTWARE_WITHOUT_CUDA = REFUSE_CUDA + """
from pipeline import record
facts = record.software()
print("facts:", sorted(facts))
print("calls:", calls)
"""


def test_the_software_facts_never_initialise_cuda(tmp_path):
    """Recorded in every rank, on GPU hosts too, before the rank picks its device: nothing may
    reach torch's CUDA runtime (torch.backends.cudnn.version() would), nor the driver's cuInit (the
    stand-in driver logs every call)."""
    build_stand_in_driver(tmp_path)
    log = tmp_path / "calls"
    done = subprocess.run([sys.executable, "-c", SOFTWARE_WITHOUT_CUDA], cwd=ROOT, capture_output=True, text=True,
                          env=subprocess_env(LD_LIBRARY_PATH=str(tmp_path), STAND_IN_CUDA_LOG=str(log)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "calls: []", done.stdout
    assert "cudnn_version" in done.stdout and "nccl_version" in done.stdout
    assert "cuInit" not in (log.read_text().split() if log.exists() else [])


@pytest.mark.fast
def test_a_gpu_run_records_nccl_s_settings_and_a_reproduction_names_a_change(monkeypatch):
    """NCCL_ALGO, NCCL_PROTO and the like change how NCCL sums (so the weights' last bits); its
    log settings do not. A GPU run's record holds them, and the verdict names one that changed."""
    import os

    import torch

    from pipeline.reproduce import facts_that_differ

    for key in [k for k in os.environ if k.startswith("NCCL_")]:
        monkeypatch.delenv(key)
    assert record.nccl_environment() == "none"
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_DEBUG_SUBSYS", "INIT")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    facts = record.gpus()
    assert facts["nccl_env"] == "NCCL_ALGO=Tree; NCCL_PROTO=Simple"
    remade = dict(facts, nccl_env="none")
    assert facts_that_differ(facts, remade) == ["nccl_env NCCL_ALGO=Tree; NCCL_PROTO=Simple -> none"]


IMPORTED_THEN_SAVED = """
import multiprocessing, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import pipeline.loop  # what a fork server imports before its workers start
from pipeline import record
from pipeline.errors import PipelineError
assert record.__file__.startswith(sys.argv[1]), record.__file__
Path(sys.argv[1], "pipeline", "report.py").write_text("# not imported yet: what it says cannot have run\\n")
record.check_code_as_imported()
Path(sys.argv[1], "pipeline", "loop.py").write_text(Path(sys.argv[1], "pipeline", "loop.py").read_text() + "# saved\\n")

def worker():
    try:
        record.inputs({}, Path(sys.argv[1]))
    except PipelineError as exc:
        print(exc)

if __name__ == "__main__":
    child = multiprocessing.get_context("fork").Process(target=worker)  # a worker forked after the imports
    child.start()
    child.join()
"""


@pytest.mark.fast
def test_a_file_saved_after_the_imports_is_not_recorded_as_what_trained(tmp_path):
    """The record reads the code on disk; a worker runs what its fork server imported earlier. A
    file saved in between would be named as the code that trained: the worker refuses instead."""
    import shutil

    for package in ("pipeline", "stages"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "imported_then_saved.py"
    script.write_text(IMPORTED_THEN_SAVED)
    done = subprocess.run([sys.executable, "-I", str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == ("pipeline/loop.py changed on disk after this training imported it: its record "
                                   "would name code that did not train; train again"), done.stdout + done.stderr[-2000:]


def torch_threads() -> int:
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                          capture_output=True, text=True, env=subprocess_env(), check=True)
    return int(done.stdout)


def runs_reproducing(client: MlflowClient, run_id: str) -> list:
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, f"tags.reproduces = '{run_id}'")


def test_a_stopped_reproduction_stops_its_training(trained):
    """Stopped (SIGTERM to its pid, or Ctrl-C), a reproduction stops the training it started, whose
    runs say from their start what they reproduce and end FAILED, removes its checkout, and exits
    143 or 130, not 1. Each step of the training pauses (the loop's test hook), so it still trains
    when the signal comes."""
    import signal
    import time

    import psutil

    client = client_of(trained)
    for mode, signum, code in (("ddp", signal.SIGTERM, 143), ("single", signal.SIGINT, 130)):
        original = parent_of(trained, mode)
        started = len(runs_reproducing(client, original))
        env = subprocess_env(**project_env(trained, MNIST_PIPELINE_STEP_PAUSE_S="0.5"))
        with subprocess.Popen(["mnist-pipeline", "reproduce", original], cwd=trained, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) as proc:
            for line in proc.stdout:
                if line.startswith(f"reproduce: training {mode} as run"):
                    break
            deadline = time.monotonic() + scaled(300)
            while len(runs_reproducing(client, original)) < started + (3 if mode == "ddp" else 1):
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-3000:]
                time.sleep(0.2)
            family = psutil.Process(proc.pid).children(recursive=True)
            assert family, "the training runs in a process of its own"
            proc.send_signal(signum)  # to its pid alone, as `kill` does
            _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == code, stderr[-3000:]
        assert f"reproduce: stopped ({signal.Signals(signum).name})" in stderr, stderr[-3000:]
        assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], family
        assert not list((trained / ".dvc" / "tmp").glob("reproduce-*"))
        stopped = runs_reproducing(client, original)[: 3 if mode == "ddp" else 1]
        assert {r.info.status for r in stopped} == {"FAILED"}, [(r.info.run_name, r.info.status) for r in stopped]


def test_a_submodule_is_checked_out_as_it_trained_and_a_dirty_one_refused(tmp_path, mnist_dir):
    """The code imports a package from a git submodule: the reproduction checks it out at the
    run's commit from the workspace's own copy (no network). A submodule with changes of its own
    is refused before anything trains: the project's patch keeps only its '-dirty' mark."""
    lib = tmp_path / "teamlib"
    lib.mkdir()
    (lib / "__init__.py").write_text("WIDTH = 64\n")
    for command in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "teamlib"]):
        run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *command], lib)
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "epochs": 1}})
    run(["git", "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "teamlib"], project)
    model = project / "pipeline" / "model.py"
    model.write_text(model.read_text().replace("from __future__ import annotations\n",
                                               "from __future__ import annotations\n\nimport teamlib\n", 1)
                     .replace("nn.Linear(32 * 7 * 7, 128)", "nn.Linear(32 * 7 * 7, teamlib.WIDTH)")
                     .replace("nn.Linear(128, 10),\n    )\n\n\ndef classic", "nn.Linear(teamlib.WIDTH, 10),\n    )\n\n\ndef classic"))
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "the model from teamlib"], project)
    prepare(project, mnist_dir)
    train_cli(project, "single")
    proc = reproduce(project, parent_of(project, "single"))
    assert proc.returncode == 0 and verdict(proc).startswith("reproduce: reproduced bit for bit"), verdict(proc)

    (project / "teamlib" / "__init__.py").write_text("WIDTH = 32\n")  # inside the submodule, uncommitted
    train_cli(project, "single")
    proc = reproduce(project, parent_of(project, "single"))
    assert proc.returncode == 2, verdict(proc)
    assert verdict(proc).startswith(f"reproduce: run {parent_of(project, 'single')}: its submodule teamlib had "
                                    "uncommitted changes"), verdict(proc)
    assert "reproduce: training" not in proc.stdout
