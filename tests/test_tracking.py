"""MLflow runs per mode and per rank, against a real server and the default SQLite store."""

import hashlib
import json
import platform
import signal
import subprocess

import mlflow
import pytest
import torch
import yaml
from mlflow import MlflowClient

from pipeline import record
from pipeline.model import build_model
from pipeline.tracking.model import load_model
from tests.conftest import (SMALL, first_epoch_run, free_port, make_project, prepare, project_env, run,
                            subprocess_env)

PARENT_METRICS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "samples_per_s", "epoch_time_s")
CHILD_METRICS = ("loss", "samples_per_s", "data_time_s", "forward_time_s", "backward_time_s", "optimizer_time_s",
                 "peak_memory_mb", "weight_checksum")


def project_with(root, mnist_dir, name, **sections):
    params = {section: dict(values) for section, values in SMALL.items()}
    for section, values in sections.items():
        params.setdefault(section, {}).update(values)
    project = make_project(root / name, params)
    prepare(project, mnist_dir)
    return project


def runs_of(client: MlflowClient, project, mode: str):
    ids = json.loads((project / "models" / mode / "mlflow_run.json").read_text())
    parent = client.get_run(ids["parent"])
    children = client.search_runs([ids["experiment_id"]], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return parent, sorted(children, key=lambda r: int(r.data.tags["rank"]))


def check_structure(client, project, mode, world_size, epochs=2):
    parent, children = runs_of(client, project, mode)
    assert parent.info.run_name == mode and parent.info.status == "FINISHED"
    tags = parent.data.tags
    assert tags["mode"] == mode and tags["world_size"] == str(world_size) and tags["device_type"] == "cpu"
    for key in ("backend", "device_name", "git_commit", "git_dirty", "torch_version", "cuda_version", "host"):
        assert tags[key]
    assert parent.data.params["train.batch_size"] == "100"
    assert parent.data.params["batch_shares"] == "/".join([str(100 // world_size)] * world_size)
    for key in PARENT_METRICS:
        assert [m.step for m in client.get_metric_history(parent.info.run_id, key)] == list(range(1, epochs + 1)), key
    assert any(key.startswith("system/") for key in parent.data.metrics)
    assert [c.info.run_name for c in children] == [f"{mode}/rank-{r}" for r in range(world_size)]
    checksums = []
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["world_size"] == str(world_size) and "local_rank" in child.data.tags
        for key in CHILD_METRICS:
            history = client.get_metric_history(child.info.run_id, key)
            assert [m.step for m in history] == list(range(1, epochs + 1)), key
        checksums.append([m.value for m in client.get_metric_history(child.info.run_id, "weight_checksum")])
        # Its log, and its profiler trace of the traced steps (train.trace_steps), which opens in Perfetto.
        assert [a.path for a in client.list_artifacts(child.info.run_id)] == [
            f"rank-{child.data.tags['rank']}.log", f"trace-rank-{child.data.tags['rank']}.json"]
        # The last epoch's measured step, phase by phase, on the rank's own run.
        assert child.data.metrics["step_step_s"] > 0 and child.data.metrics["step_compute_s"] > 0
    assert all(c == checksums[0] for c in checksums)  # every rank in sync, epoch by epoch
    check_record(parent, children, project, mode)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"checkpoint.pt", "params.yaml", f"{mode}.csv"} <= artifacts
    return parent, children


def check_record(parent, children, project, mode) -> None:
    """Every run of the training carries what re-makes it, each digest recomputed here from the
    project's files; the parent also the weights' digest, recomputed from the saved model."""
    expected = {"code_sha256": record.code_digest(record.code_folders_in(project)),
                "data_sha256": record.files_digest(project / "data" / "prepared"),
                "requirements_lock_sha256": hashlib.sha256((project / "requirements.lock").read_bytes()).hexdigest(),
                "params_sha256": record.params_digest(parent.data.params),
                "python_version": platform.python_version(), "torch_version": torch.__version__,
                "git_commit": run(["git", "rev-parse", "HEAD"], project).stdout.strip()}
    for each in (parent, *children):
        assert {key: each.data.tags.get(key) for key in expected} == expected, each.info.run_name
        for key in ("cudnn_version", "nccl_version", "cpu_model", "cuda_version"):
            assert each.data.tags[key]
    assert ("git_patch" in parent.data.tags) == (parent.data.tags["git_dirty"] == "true")
    assert parent.data.tags["weights_sha256"] == record.saved_weights_digest(project / "models" / mode / "model.pt")


# What the claims below read of a training, each trained once for the file (none trains again in
# these projects or changes their files): a cold training is about 8 s of CPU, mostly imports.
@pytest.fixture(scope="module")
def server_ddp(tmp_path_factory, mnist_dir, mlflow_server):
    """ddp at 4 ranks against a real server: its project and what it printed."""
    project = project_with(tmp_path_factory.mktemp("srv"), mnist_dir, "srv", train={"nproc": 4},
                           tracking={"log_every_n_steps": 5})
    result = run(["mnist-pipeline", "train", "--mode", "ddp"], project,
                 **project_env(project, MLFLOW_TRACKING_URI=mlflow_server))
    return project, result.stdout + result.stderr


@pytest.fixture(scope="module")
def registry_project(tmp_path_factory, mnist_dir):
    """ddp, then single, with tracking.registered_model, on a new SQLite store (ddp's training makes its
    schema): the project and what each mode printed."""
    project = project_with(tmp_path_factory.mktemp("registry"), mnist_dir, "registry",
                           tracking={"registered_model": "mnist-cnn"})
    assert not (project / "mlflow.db").exists()
    printed = {}
    for mode in ("ddp", "single"):
        result = run(["mnist-pipeline", "train", "--mode", mode], project, **project_env(project))
        printed[mode] = result.stdout + result.stderr
    return project, printed


def test_ddp_four_ranks_against_a_real_server(server_ddp, mlflow_server):
    project, _ = server_ddp
    client = MlflowClient(mlflow_server)
    parent, children = check_structure(client, project, "ddp", 4)
    assert parent.data.tags["backend"] == "gloo"
    steps = [m.step for m in client.get_metric_history(children[0].info.run_id, "step_loss")]
    assert steps == [5, 10, 15, 20]

    mlflow.set_tracking_uri(mlflow_server)
    logged = load_model(f"runs:/{parent.info.run_id}/model")
    saved = torch.load(project / "models/ddp/model.pt", weights_only=True)
    local = build_model(saved["workload"]["init_args"]["model"])
    local.load_state_dict(saved["state_dict"])
    batch = torch.randn(16, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(logged.eval()(batch), local.eval()(batch))


@pytest.fixture(scope="module")
def sqlite_project(tmp_path_factory, mnist_dir):
    return project_with(tmp_path_factory.mktemp("sqlite"), mnist_dir, "proj", train={"nproc": 4})


@pytest.mark.parametrize("mode, world_size", [("single", 1), ("dp", 1), ("ddp", 4)])
def test_default_sqlite_store(sqlite_project, mode, world_size):
    result = run(["mnist-pipeline", "train", "--mode", mode], sqlite_project, **project_env(sqlite_project))
    assert "database is locked" not in result.stderr
    assert (sqlite_project / "mlflow.db").is_file() and (sqlite_project / "mlartifacts").is_dir()
    client = MlflowClient(f"sqlite:///{sqlite_project / 'mlflow.db'}")
    check_structure(client, sqlite_project, mode, world_size)


def test_unreachable_store_fails_before_training(sqlite_project):
    uri = f"http://127.0.0.1:{free_port()}"
    for mode in ("single", "ddp"):
        result = run(["mnist-pipeline", "train", "--mode", mode], sqlite_project, check=False,
                     **project_env(sqlite_project, MLFLOW_TRACKING_URI=uri))
        assert result.returncode == 1
        assert f"MLFLOW_TRACKING_URI={uri}: the tracking server does not answer" in result.stderr
        assert "epoch" not in result.stderr and "launching" not in result.stdout


def test_tracking_can_be_turned_off(sqlite_project, tmp_path):
    params = yaml.safe_load((sqlite_project / "params.yaml").read_text())
    params["tracking"]["enabled"] = False
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    uri = f"http://127.0.0.1:{free_port()}"  # unreachable, and not needed
    run(["mnist-pipeline", "train", "--mode", "single", "--params", str(path)], sqlite_project,
        **project_env(sqlite_project, MLFLOW_TRACKING_URI=uri))
    assert json.loads((sqlite_project / "models/single/mlflow_run.json").read_text()) == {}


@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_killed_training_ends_failed(tmp_path, mnist_dir, mode):
    project = project_with(tmp_path, mnist_dir, "killed", train={"epochs": 200, "nproc": 2})
    proc = subprocess.Popen(["mnist-pipeline", "train", "--mode", mode], cwd=project, text=True,
                            env=subprocess_env(**project_env(project)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    parent = first_epoch_run(project, mode, proc, timeout=120)
    if parent is None:  # still running, or ended: its output either way
        proc.kill()
        pytest.fail(f"no first epoch: {proc.communicate()}")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]  # a signalled process's exit, in either mode
    runs = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_runs([parent.info.experiment_id])
    assert len(runs) == 1 + (2 if mode == "ddp" else 1)
    statuses = {r.info.run_name: r.info.status for r in runs}
    assert set(statuses.values()) == {"FAILED"}, (statuses, stderr[-3000:])


URL_NAME = "q?x %41 #h ünï"  # a raw `?` starts a SQLite URL's query, `%41` decodes, `#` starts a fragment


@pytest.fixture(scope="module")
def resumed_in_url_folder(tmp_path_factory, mnist_dir):
    """single crashed after its first epoch and resumed, in a project whose folder's name holds URL
    characters: the folder the project is in, and the project. Two claims read it, neither trains
    in it again: a resume reopens the runs through the same URL a fresh training makes them by."""
    root = tmp_path_factory.mktemp("url")
    project = project_with(root, mnist_dir, URL_NAME)
    crashed = run(["mnist-pipeline", "train", "--mode", "single"], project, check=False,
                  **project_env(project, MNIST_PIPELINE_CRASH_AFTER_EPOCH="1"))
    assert crashed.returncode == 75, crashed.stderr[-3000:]
    run(["mnist-pipeline", "train", "--mode", "single", "--resume"], project, **project_env(project))
    return root, project


def url_folder_store(project) -> str:
    """The project's own SQLite store, its URL escaped as SQLAlchemy reads it."""
    return f"sqlite:///{project / 'mlflow.db'}".replace("%", "%25").replace("?", "%3F")


def test_a_resumed_training_continues_the_same_runs(resumed_in_url_folder):
    _, project = resumed_in_url_folder
    client = MlflowClient(url_folder_store(project))
    parent, children = runs_of(client, project, "single")
    experiment_runs = client.search_runs([parent.info.experiment_id])
    assert len(experiment_runs) == 2  # the one parent and its one child, continued, not doubled
    check_structure(client, project, "single", 1)


def test_a_run_prints_the_projects_lines_not_mlflows(registry_project, server_ddp):
    """ddp's launcher and workers, on a new SQLite store (its schema is made) and against a server."""
    for output in (registry_project[1]["ddp"], server_ddp[1]):
        assert "ddp epoch 2/2: train loss" in output
        for chatter in ("INFO mlflow", "Creating initial MLflow database tables", "Skip logging GPU metrics",
                        "View run", "Saving pytorch model by Pickle"):
            assert chatter not in output, (chatter, output[-3000:])


def test_an_opt_in_registry_holds_each_modes_model_under_its_alias(registry_project):
    """tracking.registered_model: each mode's model is a version; `models:/<name>@<mode>` loads it."""
    project, _ = registry_project
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(uri)
    versions = {mode: client.get_model_version_by_alias("mnist-cnn", mode) for mode in ("single", "ddp")}
    assert {str(v.version) for v in versions.values()} == {"1", "2"}
    for mode, version in versions.items():
        ids = json.loads((project / "models" / mode / "mlflow_run.json").read_text())
        assert version.run_id == ids["parent"] and version.tags["mode"] == mode
        mlflow.set_tracking_uri(uri)
        loaded = load_model(f"models:/mnist-cnn@{mode}")
        saved = torch.load(project / "models" / mode / "model.pt", weights_only=True)["state_dict"]
        assert {k: v.tolist() for k, v in loaded.state_dict().items()} == {k: v.tolist() for k, v in saved.items()}


def test_a_registered_model_name_mlflow_would_refuse_is_refused_before_training(tmp_path):
    from tests.conftest import ROOT, write_params

    params = write_params(tmp_path / "params.yaml", tracking={"registered_model": "team/mnist"})
    result = run(["mnist-pipeline", "train", "--mode", "single", "--params", str(params)], tmp_path, check=False,
                 **project_env(ROOT))
    assert result.returncode == 1 and "tracking.registered_model" in result.stderr and "team/mnist" in result.stderr


@pytest.mark.parametrize("name", ["q?x", "p%41", "h#sh", "with space", "ünï"])
def test_the_store_url_names_the_project_file_as_sqlalchemy_reads_it(tmp_path, name):
    from sqlalchemy.engine import make_url

    from pipeline.tracking.store import sqlite_uri

    path = tmp_path / name / "mlflow.db"
    assert make_url(sqlite_uri(path)).database == str(path)


def test_a_project_in_a_folder_with_url_characters_logs_into_its_own_store(resumed_in_url_folder):
    """A raw `?` in the SQLite URL starts a query and `%41` decodes: the runs went into a file
    beside the project, and the training exited 0 (its resume too, which reopened them)."""
    root, project = resumed_in_url_folder
    # Nothing logged beside it. MLflow 3 makes the folder its URL names as written, undecoded
    # (store/db/utils.py: _make_parent_dirs_if_sqlite): that one stays empty.
    beside = [p for p in root.iterdir() if p.name != URL_NAME]
    assert [p.name for p in beside] in ([], ["q%3Fx %2541 #h ünï"]) and all(not list(p.iterdir()) for p in beside)
    uri = url_folder_store(project)
    client = MlflowClient(uri)
    parent, [child] = runs_of(client, project, "single")
    assert parent.info.status == child.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"params.yaml", "checkpoint.pt"}
    artifacts = project / "mlartifacts" / parent.info.run_id / "artifacts"
    assert (artifacts / "params.yaml").is_file()  # in the project's own artifact folder
    mlflow.set_tracking_uri(uri)
    logged = load_model(f"runs:/{parent.info.run_id}/model")
    saved = torch.load(project / "models/single/model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(logged.state_dict()[k], saved[k]) for k in saved)
