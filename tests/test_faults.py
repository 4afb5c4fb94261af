"""The second hostile set (docs/failures.md): faults that used to be found only after the disk
changed, named the wrong cause, or let a wrong record stand. Each goes through the real part: a
real SQLite lock, a real file in the way, a real run deleted in the store, a real tmpfs that fills."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import SMALL, make_project, prepare, project_env, run, scaled, subprocess_env, train_cli
from tests.test_start_checks import assert_refused_and_untouched, digests, plant_previous_training


@pytest.fixture(scope="module")
def project(tmp_path_factory, mnist_dir):
    project = make_project(tmp_path_factory.mktemp("faults") / "proj", SMALL)
    prepare(project, mnist_dir)
    return project


def hold_sqlite_lock(store: Path, seconds: float) -> subprocess.Popen:
    """Another process in a write transaction on `store` (BEGIN EXCLUSIVE) for `seconds`."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"db = sqlite3.connect({str(store)!r}, isolation_level=None)\n"
        "db.execute('PRAGMA journal_mode=WAL'); db.execute('BEGIN EXCLUSIVE')\n"
        # The moment it lets go, on the clock every process shares.
        f"print('locked', flush=True); time.sleep({seconds}); print(time.monotonic(), flush=True); "
        "db.execute('ROLLBACK')\n")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    return holder


def test_a_store_held_locked_is_refused_in_one_line_before_the_disk_changes(project, tmp_path, monkeypatch):
    """MLflow's engine gives up after SQLite's 5 s, after the checkpoint was removed; the start
    check waits as long as a busy store may take (SQLITE_BUSY_S), then says who holds it."""
    from pipeline.tracking import store as tracking
    from pipeline.errors import PipelineError

    store = tmp_path / "mlflow.db"
    sqlite3.connect(store).execute("CREATE TABLE t (x)")
    holder = hold_sqlite_lock(store, 3600)  # past the command's start and its 30 s wait, on any day: killed below
    try:
        monkeypatch.setattr(tracking, "SQLITE_BUSY_S", 1)
        with pytest.raises(PipelineError, match="another process has held .* locked for over 1 s"):
            tracking.check_store(f"sqlite:///{store}")
        before = plant_previous_training(project, "single")  # and through the real command, at 30 s
        result = train_cli(project, "single", check=False, MLFLOW_TRACKING_URI=f"sqlite:///{store}")
    finally:
        holder.kill()
        holder.wait()
    assert_refused_and_untouched(project, "single", before, result, "locked for over 30 s")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_lock_released_in_time_only_delays_the_start(tmp_path):
    from pipeline.tracking.store import check_store

    store = tmp_path / "mlflow.db"
    sqlite3.connect(store).execute("CREATE TABLE t (x)")
    holder = hold_sqlite_lock(store, 2)
    try:
        check_store(f"sqlite:///{store}")
        returned = time.monotonic()
        let_go = float(holder.stdout.readline())
    finally:
        holder.kill()
        holder.wait()
    assert returned > let_go  # it met the lock and waited it out


def test_a_locked_store_is_named_as_locked_not_by_sqlalchemys_note():
    """The outbox's warning gives the database's own words."""
    from sqlalchemy.exc import OperationalError

    from pipeline.tracking.outbox import _short

    wrapped = OperationalError("(raised as a result of Query-invoked autoflush; consider using a session.no_autoflush "
                               "block if this flush is occurring prematurely)", None,
                               sqlite3.OperationalError("database is locked"))
    assert _short(wrapped) == "database is locked"
    assert _short(Exception("(raised as a result of Query-invoked autoflush)\n"
                            "(sqlite3.OperationalError) database is locked")).endswith("database is locked")


def test_a_file_where_the_artifact_folder_goes_is_found_before_training(project):
    before = plant_previous_training(project, "single")
    (project / "mlartifacts").write_text("not a folder")
    try:
        result = train_cli(project, "single", check=False)
    finally:
        (project / "mlartifacts").unlink()
    assert_refused_and_untouched(project, "single", before, result,
                                 "mlartifacts: a file is in the way")


def test_enotdir_is_a_refusal_not_an_outage():
    from pipeline.tracking.store import refused

    assert refused(NotADirectoryError(20, "Not a directory"))
    assert refused(OSError(20, "Not a directory"))


@pytest.mark.parametrize("folder", ["logs", "run-files", "traces", "tracking-outbox"])
def test_a_file_where_an_output_folder_goes_is_found_before_anything_is_removed(project, folder):
    plant_previous_training(project, "single")
    in_the_way = project / "models/single" / folder
    if in_the_way.is_dir():
        shutil.rmtree(in_the_way)
    in_the_way.write_text("a file, not a folder")
    before = digests(project / "models/single")
    try:
        result = train_cli(project, "single", check=False)
        assert_refused_and_untouched(project, "single", before, result, f"models/single/{folder}: a file is in the way")
    finally:
        in_the_way.unlink()
    assert "permissions" not in result.stderr


def path_of_length(root: Path, length: int) -> Path:
    """A folder under `root` whose `mlflow.db` path is `length` bytes (components under NAME_MAX)."""
    folder = root
    while len(os.fsencode(folder / "mlflow.db")) + 101 < length:
        folder = folder / ("d" * 100)
    folder = folder / ("x" * (length - len(os.fsencode(folder / "mlflow.db")) - 1))
    folder.mkdir(parents=True)
    assert len(os.fsencode(folder / "mlflow.db")) == length
    return folder


def test_a_store_path_past_sqlites_limit_names_the_limit(tmp_path, monkeypatch):
    from pipeline.errors import PipelineError
    from pipeline.tracking.store import SQLITE_MAX_PATH, check_store

    too_long = path_of_length(tmp_path / "a", SQLITE_MAX_PATH + 1)
    with pytest.raises(PipelineError, match=f"longer than the {SQLITE_MAX_PATH} bytes SQLite can open"):
        check_store(f"sqlite:///{too_long / 'mlflow.db'}")
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):  # the limit is SQLite's own
        sqlite3.connect(too_long / "mlflow.db").execute("CREATE TABLE t (x)")
    fits = path_of_length(tmp_path / "b", SQLITE_MAX_PATH)
    monkeypatch.setenv("DVC_ROOT", str(fits))  # its artifact folder beside it
    check_store(f"sqlite:///{fits / 'mlflow.db'}")


def test_a_run_deleted_in_the_store_counts_as_missing(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from pipeline.config import TrackingConfig, load_config
    from pipeline.tracking.runs import missing_runs

    store = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(store)
    experiment = client.create_experiment("x")
    parent, child = (client.create_run(experiment).info.run_id for _ in range(2))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    config: TrackingConfig = load_config(Path(__file__).parents[1] / "params.yaml").tracking
    ids = {"parent": parent, "children": {0: child}}
    assert missing_runs(config, ids) == []
    client.delete_run(child)
    assert missing_runs(config, ids) == [child]


def test_a_run_deleted_during_training_is_said_so_and_the_way_on_works(project):
    """Deleted in the UI while the training logs to it: the refusal says the run is gone, no run is
    left RUNNING, and the next training starts new runs instead of failing to reopen the old."""
    from mlflow import MlflowClient

    from tests.conftest import first_epoch_run, write_params

    out = project / "models/single"
    shutil.rmtree(out, ignore_errors=True)
    write_params(project / "longer.yaml", **{**SMALL, "train": {**SMALL["train"], "epochs": 3}})
    # Each step pauses (the loop's test hook): the 2 epochs after the first last 4 s, idle.
    proc = subprocess.Popen(["mnist-pipeline", "train", "--mode", "single", "--params", "longer.yaml"], cwd=project,
                            env=subprocess_env(**project_env(project, MNIST_PIPELINE_STEP_PAUSE_S="0.2")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        parent = first_epoch_run(project, "single", proc)
        assert parent is not None, proc.communicate()[1][-3000:]
        client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
        client.delete_run(parent.info.run_id)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert "a run of this training was deleted in the tracking store" in stderr, stderr[-3000:]
    assert "send-runs --mode single --discard" in stderr and "Traceback" not in stderr
    ids = json.loads((out / "mlflow_run.json").read_text())
    for run_id in ids["children"].values():
        assert client.get_run(run_id).info.status == "FAILED"
    # Same settings, data and code: it would go on, but its runs are gone, so it starts afresh, in
    # new runs; what it kept for the deleted runs cannot be sent, and is dropped, saying so.
    again = train_cli(project, "single", "--params", "longer.yaml")
    assert "were deleted from) the tracking store" in again.stderr and "continuing" not in again.stderr
    assert "single: dropped" in again.stderr, again.stderr[-3000:]
    assert json.loads((out / "mlflow_run.json").read_text())["parent"] != parent.info.run_id


def test_prepared_data_changed_after_prepare_is_refused_before_training(project, tmp_path):
    shutil.copytree(project / "data/prepared", tmp_path / "prepared")
    blob = torch.load(tmp_path / "prepared/train.pt", weights_only=True)
    blob["labels"][:] = 3  # what a damaged cache entry held: every label a 3
    torch.save(blob, tmp_path / "prepared/train.pt")
    before = plant_previous_training(project, "single")
    result = train_cli(project, "single", "--data-dir", str(tmp_path / "prepared"), check=False)
    assert_refused_and_untouched(project, "single", before, result,
                                 "train.pt: changed since `prepare` wrote it (its class counts are")
    blob = torch.load(project / "data/prepared/train.pt", weights_only=True)
    blob["images"][0, 0, 0] ^= 1  # one pixel: the counts hold, the digest does not
    torch.save(blob, tmp_path / "prepared/train.pt")
    result = train_cli(project, "single", "--data-dir", str(tmp_path / "prepared"), check=False)
    assert_refused_and_untouched(project, "single", before, result, "do not match the SHA-256 in stats.json")


def test_params_edited_during_a_training_fail_the_stage_naming_the_keys(project):
    out = project / "models/single"
    shutil.rmtree(out, ignore_errors=True)
    params = project / "params.yaml"
    original = params.read_text()
    # Paused after each step (the weights are the same): the edit below lands while it trains, however
    # late this process wakes.
    proc = subprocess.Popen(["mnist-pipeline", "train", "--mode", "single"], cwd=project,
                            env=subprocess_env(**project_env(project, MNIST_PIPELINE_STEP_PAUSE_S="0.2")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + scaled(300)
        while not (out / "unfinished.json").is_file():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        edited = yaml.safe_load(original)
        edited["train"]["lr"] = 0.0001
        params.write_text(yaml.safe_dump(edited, sort_keys=False))
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        params.write_text(original)
    assert proc.returncode == 1, stderr[-3000:]
    assert "params.yaml changed while this training ran (train.lr:" in stderr, stderr[-3000:]
    kept = (out / "run-files/params.yaml").read_text()
    assert kept == original  # the run's record says what trained


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a tmpfs")
def test_a_full_disk_during_prepare_is_one_line_naming_the_file(project, mnist_dir):
    result = subprocess.run(["unshare", "--mount", "sh", "-c",
                             "mkdir -p full && mount -t tmpfs -o size=2m tmpfs full && "
                             "exec mnist-pipeline prepare --out full/prepared"],
                            cwd=project, capture_output=True, text=True,
                            env=subprocess_env(**project_env(project, MNIST_SOURCE=str(mnist_dir))))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "full/prepared/" in result.stderr and ".pt: could not be written (torch.save failed" in result.stderr, \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_tmpdir_too_long_for_the_fork_servers_socket_is_named_before_the_disk_changes(project, tmp_path):
    from pipeline.runtime.forkserver import SOCKET_NAME_BYTES, UNIX_PATH_MAX

    long_tmp = tmp_path / ("t" * (UNIX_PATH_MAX - SOCKET_NAME_BYTES - len(os.fsencode(tmp_path))))
    long_tmp.mkdir()
    before = plant_previous_training(project, "ddp")
    result = train_cli(project, "ddp", check=False, TMPDIR=str(long_tmp))
    assert_refused_and_untouched(project, "ddp", before, result, f"TMPDIR={long_tmp} is",
                                 f"over the {UNIX_PATH_MAX} a Unix socket allows")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
