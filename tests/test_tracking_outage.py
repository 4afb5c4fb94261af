"""The tracking server goes away mid-training (a real `mlflow server`, killed after epoch 1):
training goes on, what it logs is kept in the mode's folder, and reaches the server when it is back,
at the end of the stage or through `mnist-pipeline send-runs`."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow import MlflowClient

from pipeline.tracking.model import load_model

from tests.conftest import SERVER_ENV, free_port, project_env, run, subprocess_env
from tests.test_tracking import project_with

EPOCHS = 4


class Server:
    """A real tracking server that a test can kill and start again, same port, same store."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        home.mkdir(parents=True, exist_ok=True)
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        with (self.home / "server.log").open("a") as log:
            self.proc = subprocess.Popen(
                ["mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{self.home / 'server.db'}",
                 "--artifacts-destination", str(self.home / "artifacts")],
                cwd=self.home, env=subprocess_env(**SERVER_ENV), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)
                return
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, (self.home / "server.log").read_text()
                time.sleep(0.3)

    def kill(self) -> None:
        """Gone at once, as a crashed or unplugged server is."""
        os.killpg(self.proc.pid, 9)
        self.proc.wait(timeout=30)


class Training:
    """`mnist-pipeline train --mode single`, its output read line by line as it comes."""

    def __init__(self, project: Path, uri: str, **env: str):
        self.proc = subprocess.Popen(["mnist-pipeline", "train", "--mode", "single"], cwd=project, text=True,
                                     env=subprocess_env(**project_env(project, MLFLOW_TRACKING_URI=uri, **env)),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            line = self._queue.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"ended before {text!r}:\n{''.join(self.lines)}"
            self.lines.append(line)

    def finish(self, timeout: float = 300) -> str:
        self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return "".join(self.lines)


def assert_runs_complete(project: Path, uri: str) -> None:
    client = MlflowClient(uri)
    ids = json.loads((project / "models/single/mlflow_run.json").read_text())
    parent, child = client.get_run(ids["parent"]), client.get_run(ids["children"]["0"])
    assert (parent.info.status, child.info.status) == ("FINISHED", "FINISHED")
    for key in ("val_accuracy", "train_loss", "samples_per_s"):  # every epoch, none lost
        assert [m.step for m in client.get_metric_history(parent.info.run_id, key)] == list(range(1, EPOCHS + 1))
    assert [m.step for m in client.get_metric_history(child.info.run_id, "loss")] == list(range(1, EPOCHS + 1))
    assert {a.path for a in client.list_artifacts(child.info.run_id)} == {"rank-0.log", "trace-rank-0.json"}
    assert {"checkpoint.pt", "single.csv", "params.yaml"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    mlflow.set_tracking_uri(uri)
    logged = load_model(f"runs:/{parent.info.run_id}/model")
    saved = torch.load(project / "models/single/model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(logged.state_dict()[k], saved[k]) for k in saved)


def server_killed_after_epoch_1(tmp_path: Path, mnist_dir: Path, outage_wait_s: float):
    """A training of EPOCHS epochs whose tracking server dies once epoch 1 is logged."""
    project = project_with(tmp_path, mnist_dir, "proj", train={"epochs": EPOCHS},
                           tracking={"outage_wait_s": outage_wait_s, "system_metrics": False})
    server = Server(tmp_path / "server")
    server.start()
    training = Training(project, server.uri)
    try:
        training.wait_for("single epoch 1/4")
    except BaseException:
        training.proc.kill()
        raise
    finally:
        server.kill()
    return project, server, training


def test_training_never_waits_and_everything_arrives_when_the_server_is_back(tmp_path, mnist_dir):
    project, server, training = server_killed_after_epoch_1(tmp_path, mnist_dir, outage_wait_s=300)
    try:
        # Every later epoch ends while the server is away: the loop does not wait on it.
        training.wait_for(f"single epoch {EPOCHS}/{EPOCHS}")
        assert training.proc.poll() is None  # waiting for the server, with everything kept on disk
        assert (project / "models/single/tracking-outbox/rank-0.jsonl").is_file()
        server.start()
        output = training.finish()
        assert training.proc.returncode == 0, output
        assert "tracking server unreachable" in output and "answers again" in output
        assert_runs_complete(project, server.uri)
    finally:
        training.proc.kill()
        server.kill()
    assert not (project / "models/single/tracking-outbox").exists()  # all sent: nothing kept in the outputs


@pytest.fixture(scope="module")
def failed_at_its_end(tmp_path_factory, mnist_dir):
    """A training whose server died after epoch 1 and never came back within
    tracking.outage_wait_s = 3 s: its outputs saved, its stage failed. The two tests after it go
    on from copies of it (the project and the server's store), each its own way."""
    home = tmp_path_factory.mktemp("outage")
    _, _, training = server_killed_after_epoch_1(home, mnist_dir, outage_wait_s=3)
    try:
        output = training.finish()
    finally:
        training.proc.kill()
    return home, output, training.proc.returncode


def copy_of(failed_at_its_end, tmp_path: Path) -> tuple[Path, Server, str, int]:
    """The failed training's project and the server's store, copied: a server of its own on them."""
    home, output, returncode = failed_at_its_end
    for name in ("proj", "server"):
        shutil.copytree(home / name, tmp_path / name, symlinks=True)
    return tmp_path / "proj", Server(tmp_path / "server"), output, returncode


def test_a_server_that_never_comes_back_fails_the_stage_clearly_and_send_runs_completes_the_runs(
        failed_at_its_end, tmp_path):
    project, server, output, returncode = copy_of(failed_at_its_end, tmp_path)
    assert returncode == 1, output
    assert "did not take this training's tracking within tracking.outage_wait_s = 3 s" in output
    assert "`mnist-pipeline send-runs --mode single`" in output and "Traceback" not in output
    assert (project / "models/single/model.pt").is_file()  # training's outputs are saved
    # ...and the record says so: a `dvc repro` now writes them again without training or logging
    # the model twice; send-runs removes it (below), so that `dvc commit` caches no record
    parent = json.loads((project / "models/single/mlflow_run.json").read_text())["parent"]
    assert json.loads((project / "models/single/unfinished.json").read_text())["outputs_complete"] == parent
    store = MlflowClient(f"sqlite:///{tmp_path / 'server/server.db'}")  # its own file, read while no server runs
    assert store.get_run(parent).info.status == "RUNNING"

    # Sent where the user's settings say now (the copied store, at another address than the outbox
    # names), never where a file says.
    env = project_env(project, MLFLOW_TRACKING_URI=server.uri)
    still_down = run(["mnist-pipeline", "send-runs", "--mode", "single"], project, check=False, **env)
    assert still_down.returncode == 1 and "does not answer" in still_down.stderr
    server.start()
    sent = run(["mnist-pipeline", "send-runs", "--mode", "single"], project, **env)
    assert "kept tracking calls; its runs are complete" in sent.stdout
    assert "`dvc commit train@single` records them" in sent.stdout
    assert not (project / "models/single/unfinished.json").exists()  # a finished training now
    try:
        assert_runs_complete(project, server.uri)
    finally:
        server.kill()
    again = run(["mnist-pipeline", "send-runs", "--mode", "single"], project, **env)
    assert "nothing kept" in again.stdout


def test_a_repro_after_an_end_that_failed_writes_the_outputs_again_without_training_or_logging_twice(
        failed_at_its_end, tmp_path):
    """`dvc repro` instead of send-runs after the stage failed at its end: DVC deletes the stage's
    outputs but models/ first, so the training goes on from its last checkpoint. No step trains,
    the files are written again, the kept calls go, and the run gets its model once."""
    project, server, output, returncode = copy_of(failed_at_its_end, tmp_path)
    assert returncode == 1, output
    results = project / "results/train/single.json"
    results.unlink()  # as `dvc repro` does before it runs the stage again (not persist)
    # Time for the model to go this time; how long to wait is no setting the outputs depend on.
    params = project / "params.yaml"
    params.write_text(params.read_text().replace("outage_wait_s: 3", "outage_wait_s: 120"))
    server.start()
    try:
        again = run(["mnist-pipeline", "train", "--mode", "single"], project,
                    **project_env(project, MLFLOW_TRACKING_URI=server.uri))
        output = again.stdout + again.stderr
        assert "single: continuing the training interrupted in models/single" in output, output[-3000:]
        assert "single epoch" not in output  # nothing trained again
        assert results.is_file() and not (project / "models/single/unfinished.json").exists()
        assert_runs_complete(project, server.uri)
        client = MlflowClient(server.uri)
        parent = json.loads((project / "models/single/mlflow_run.json").read_text())["parent"]
        experiment = client.get_run(parent).info.experiment_id
        models = [m for m in client.search_logged_models([experiment]) if m.source_run_id == parent]
        assert len(models) == 1, [m.model_id for m in models]
    finally:
        server.kill()
