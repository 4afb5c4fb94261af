"""Results in S3-compatible storage (docs/multi-node.md, "Shared storage"), on a real S3 server on
127.0.0.1 (tests/s3.py): MLflow's artifacts in a bucket, through a server that serves them or
written by every rank itself; the DVC remote in the same bucket; an outage of the bucket; and the
credentials, which must turn up nowhere but in the environment of the processes that use them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import (SMALL, commit, make_project, project_env, run, start_mlflow_server,
                            stop_mlflow_server)
from tests.s3 import BUCKET, Cmdlines, S3Server
from tests.test_tracking import project_with
from tests.test_tracking_outage import EPOCHS, Training, assert_runs_complete


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


def leaks(secret: str, texts: list[str], folders: list[Path], cmdlines: set[str]) -> list[str]:
    """Where `secret` is found: in an output, a file under `folders` (logs, outputs, DVC's config
    and cache, the tracking store's database with every param and tag), or an argument list."""
    found = [f"output {i}" for i, text in enumerate(texts) if secret in text]
    for folder in folders:
        found += [str(path) for path in folder.rglob("*")
                  if path.is_file() and not path.is_symlink() and secret.encode() in path.read_bytes()]
    return found + [f"the arguments of {line[:80]!r}" for line in cmdlines if secret in line]


def params_and_tags(uri: str) -> list[str]:
    client = MlflowClient(uri)
    experiments = client.search_experiments()
    values = [value for e in experiments for value in e.tags.values()]
    for found in client.search_runs([e.experiment_id for e in experiments]):
        values += [*found.data.params.values(), *found.data.tags.values()]
    return values


def test_a_repro_kept_in_the_bucket_is_pulled_into_a_fresh_clone_and_reproduced_bit_for_bit(s3, tmp_path, mnist_dir):
    """The team's setup: a tracking server that keeps the artifacts in the bucket (the ranks need no
    S3 credentials for them) and the DVC remote in the same bucket (DVC's client needs them). A
    `dvc repro`, `dvc push`; then on another machine a clone, `dvc pull` and `reproduce` of the
    run, whose artifacts are nowhere but in the bucket. (Single alone: how a run's files reach the
    bucket is one path for every mode, and test_reproduce.py re-makes each mode.)"""
    home = tmp_path / "server"
    home.mkdir()
    server, uri, log = start_mlflow_server(home, artifacts=f"s3://{BUCKET}/mlartifacts", env=s3.env)
    try:
        project = make_project(tmp_path / "proj", {**SMALL, "commcheck": {"enabled": False},
                                                   "train": {**SMALL["train"], "modes": ["single"]}})
        env = project_env(project, MNIST_SOURCE=str(mnist_dir), MLFLOW_TRACKING_URI=uri, **s3.credentials)
        run(["dvc", "remote", "add", "--default", "bucket", f"s3://{BUCKET}/dvc"], project, **env)
        run(["dvc", "remote", "modify", "bucket", "endpointurl", s3.endpoint], project, **env)
        clone = tmp_path / "clone"
        clone_env = project_env(clone, MLFLOW_TRACKING_URI=uri, **s3.credentials)
        with Cmdlines() as cmdlines:
            outputs = [run(["dvc", "repro"], project, **env)]
            commit(project, "trained, the remote in the bucket")
            outputs.append(run(["dvc", "push"], project, **env))
            run(["git", "clone", "-q", str(project), str(clone)], tmp_path)
            outputs.append(run(["dvc", "pull"], clone, **clone_env))
            original = json.loads((clone / "models/single/mlflow_run.json").read_text())["parent"]
            outputs.append(run(["mnist-pipeline", "reproduce", original], clone, check=False, **clone_env))
        remade = outputs[-1]
        assert remade.returncode == 0 and "reproduce: reproduced bit for bit" in remade.stdout, remade.stdout + remade.stderr

        # What the clone pulled is what the training made, and it came from the bucket.
        for name in ("models/single/model.pt", "data/prepared/train.pt", "results/train/single.json"):
            assert (clone / name).read_bytes() == (project / name).read_bytes(), name
        assert s3.keys("dvc/files/md5/")
        # The runs' artifacts are in the bucket alone: no folder holds them on the server or in a project.
        client = MlflowClient(uri)
        experiment = client.get_run(original).info.experiment_id
        assert f"mlartifacts/{experiment}/{original}/artifacts/params.yaml" in s3.keys("mlartifacts/")
        assert not [p for p in (home, project, clone) if (p / "artifacts").exists() or (p / "mlartifacts").exists()]
        assert client.search_runs([experiment], "tags.reproduces = '%s'" % original)

        texts = [o.stdout + o.stderr for o in outputs] + params_and_tags(uri)
        for secret in (s3.secret, s3.key_id):
            assert not leaks(secret, texts, [project, clone, home], cmdlines.seen), secret
        assert any(f"s3://{BUCKET}/dvc" in line for line in [(project / ".dvc/config").read_text()])
    finally:
        stop_mlflow_server(server, log)


@pytest.fixture(scope="module")
def direct(s3, tmp_path_factory):
    """A tracking server that hands the artifacts to the clients to write (`--no-serve-artifacts`):
    each rank writes the bucket with its own credentials. The server itself has none."""
    home = tmp_path_factory.mktemp("direct")
    server, uri, log = start_mlflow_server(home, "--no-serve-artifacts", "--default-artifact-root",
                                           f"s3://{BUCKET}/direct", artifacts="")
    yield uri
    stop_mlflow_server(server, log)


def test_ranks_that_write_the_bucket_keep_what_an_outage_stops_and_send_it_when_it_is_back(
        s3, direct, tmp_path, mnist_dir, monkeypatch):
    project = project_with(tmp_path, mnist_dir, "proj", train={"epochs": EPOCHS},
                           tracking={"outage_wait_s": 300, "system_metrics": False})
    training = Training(project, direct, **s3.env)
    try:
        training.wait_for("single epoch 1/4")
        s3.relay.off()  # the bucket goes away mid-run: connections refused, as from a stopped server
        try:
            training.wait_for(f"single epoch {EPOCHS}/{EPOCHS}")
            rank_log, deadline = project / "models/single/logs/rank-0.log", time.monotonic() + 120
            while f"tracking server unreachable (Could not connect to the endpoint URL: \"{s3.endpoint}/" not in rank_log.read_text():
                assert time.monotonic() < deadline and training.proc.poll() is None, rank_log.read_text()
                time.sleep(0.5)
            assert training.proc.poll() is None  # waiting for the bucket, with everything kept on disk
            assert (project / "models/single/tracking-outbox/rank-0.jsonl").is_file()
        finally:
            s3.relay.on()
        output = training.finish()
    finally:
        training.proc.kill()
    assert training.proc.returncode == 0, output
    assert "answers again" in output, output
    for key, value in s3.env.items():  # the test reads the model back from the bucket as a team member would
        monkeypatch.setenv(key, value)
    assert_runs_complete(project, direct)
    parent = json.loads((project / "models/single/mlflow_run.json").read_text())["parent"]
    keys = s3.keys("direct/")  # the run's files, and its logged model (MLflow 3: beside the runs)
    assert any(key.endswith(f"/{parent}/artifacts/checkpoint.pt") for key in keys), keys
    assert any("/models/m-" in key and key.endswith("/MLmodel") for key in keys), keys
    assert not (project / "models/single/tracking-outbox").exists()
    for secret in (s3.secret, s3.key_id):
        assert not leaks(secret, [output, *params_and_tags(direct)], [project], set()), secret


@pytest.mark.parametrize("case", ["no credentials", "half a credential", "no bucket", "no scheme"])
def test_a_bucket_the_ranks_cannot_write_is_refused_in_one_line_before_anything_changes(
        s3, direct, tmp_path, mnist_dir, case):
    project = project_with(tmp_path, mnist_dir, "proj")
    env = dict(s3.env)
    if case in ("no credentials", "half a credential"):
        del env["AWS_SECRET_ACCESS_KEY"]
        if case == "no credentials":
            del env["AWS_ACCESS_KEY_ID"]
        says = "has no usable S3 credentials ("
    elif case == "no scheme":
        env["MLFLOW_S3_ENDPOINT_URL"] = s3.endpoint.removeprefix("http://")
        says = f"MLFLOW_S3_ENDPOINT_URL={env['MLFLOW_S3_ENDPOINT_URL']} is not usable"
    else:  # an experiment made with a location in a bucket that is not there
        experiment = f"gone-{tmp_path.name}"
        MlflowClient(direct).create_experiment(experiment, artifact_location=f"s3://{BUCKET}-gone/runs")
        params = project / "params.yaml"
        params.write_text(params.read_text().replace("experiment: mnist-data-parallel", f"experiment: {experiment}"))
        says = f"bucket '{BUCKET}-gone' does not exist at {s3.endpoint}"
    refused = run(["mnist-pipeline", "train", "--mode", "single"], project, check=False,
                  **project_env(project, MLFLOW_TRACKING_URI=direct, HOME=str(tmp_path), **env))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and len(lines) == 1 and says in lines[0], refused.stderr
    assert "Traceback" not in refused.stderr
    assert [p.name for p in (project / "models").rglob("*") if p.is_file()] == [".train.lock"]  # the stage's lock


def test_each_nodes_first_worker_checks_the_bucket_where_no_train_command_did(s3, direct, tmp_path, mnist_dir):
    """torchrun started by hand (as the TrainJob and a Slurm job start it): no `train` command ran
    the check before the workers, so each node's first one makes it, with that node's credentials."""
    project = project_with(tmp_path, mnist_dir, "proj", train={"nproc": 1})
    env = {key: value for key, value in s3.env.items() if key != "AWS_SECRET_ACCESS_KEY"}
    refused = run(["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "stages", "train", "--mode", "ddp"],
                  project, check=False, **project_env(project, MLFLOW_TRACKING_URI=direct, HOME=str(tmp_path), **env))
    assert refused.returncode != 0 and "has no usable S3 credentials (" in refused.stderr, refused.stderr[-3000:]
    assert not (project / "models/ddp/model.pt").exists()
