"""A training checks everything it can before it changes the disk: a start that fails leaves the
last training's checkpoint, logs and runs as they were (bytes compared), and says why in one line.
Also: one training of a mode at a time, data that is not MNIST refused at prepare, and `--out`
never deleting a folder the pipeline did not make."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import (SMALL, VENV_BIN, free_port, idx_bytes, make_project, prepare, project_env, run, scaled,
                            start_mlflow_server, stop_mlflow_server, subprocess_env, train_cli, write_tiny_mnist)


@pytest.fixture(scope="module")
def project(tmp_path_factory, mnist_dir):
    project = make_project(tmp_path_factory.mktemp("start") / "proj", SMALL)
    prepare(project, mnist_dir)
    return project


def plant_previous_training(project: Path, mode: str) -> dict[str, str]:
    """What a finished training left in models/<mode> (its checkpoint and logs): digests to compare."""
    out = project / "models" / mode
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "checkpoint.pt").write_bytes(b"the previous training's checkpoint " * 1000)
    (out / "logs/rank-0.log").write_text("the previous training's log\n")
    (out / "unfinished.json").unlink(missing_ok=True)
    return digests(out)


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".train.lock"}


def assert_refused_and_untouched(project, mode, before, result, *expected):
    assert result.returncode != 0, result.stdout + result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "epoch 1/" not in result.stderr
    assert digests(project / "models" / mode) == before  # no unfinished.json either


def newer_schema_store(path: Path) -> str:
    """A SQLite store as a newer MLflow leaves it: a schema revision this MLflow does not know."""
    uri = f"sqlite:///{path}"
    from mlflow import MlflowClient

    MlflowClient(uri).search_experiments()  # this MLflow's schema, complete
    with sqlite3.connect(path) as db:
        db.execute("UPDATE alembic_version SET version_num = 'ffffffffffff'")
    return uri


def test_a_store_written_by_a_newer_mlflow_is_refused_before_the_disk_changes(project, tmp_path):
    before = plant_previous_training(project, "single")
    uri = newer_schema_store(tmp_path / "newer.db")
    result = train_cli(project, "single", check=False, MLFLOW_TRACKING_URI=uri)
    assert_refused_and_untouched(project, "single", before, result,
                                 f"tracking store {uri}: its schema (ffffffffffff) was written by a newer MLflow",
                                 "`mlflow db upgrade` cannot fix that")
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_debug_switch_shows_the_traceback(project, tmp_path):
    uri = newer_schema_store(tmp_path / "newer.db")
    result = train_cli(project, "single", check=False, MLFLOW_TRACKING_URI=uri, MNIST_PIPELINE_DEBUG="1")
    assert result.returncode == 1 and "Traceback" in result.stderr and "MlflowException" in result.stderr


def test_an_experiment_name_mlflow_rejects_is_refused_before_the_disk_changes(project):
    before = plant_previous_training(project, "single")
    params = (project / "params.yaml").read_text().replace("experiment: mnist-data-parallel",
                                                             f"experiment: {'x' * 600}")
    (project / "long-name.yaml").write_text(params)
    result = train_cli(project, "single", "--params", "long-name.yaml", check=False)
    assert_refused_and_untouched(project, "single", before, result, "opening experiment 'xxxx",
                                 "tracking.enabled: false")


@pytest.mark.parametrize("mode", ["ddp", "single"])
def test_a_missing_sbatch_is_found_before_the_disk_changes(project, mode):
    """With train.launcher: slurm every mode trains in a job (single too, on a node like DDP's)."""
    before = plant_previous_training(project, mode)
    # Tracking off: a local store would be refused for ranks on several nodes first.
    params = (project / "params.yaml").read_text().replace("launcher: local", "launcher: slurm")
    params = params.replace("enabled: true\n  experiment", "enabled: false\n  experiment")
    (project / "slurm.yaml").write_text(params)
    result = train_cli(project, mode, "--params", "slurm.yaml", check=False, PATH=str(VENV_BIN))  # no sbatch
    assert_refused_and_untouched(project, mode, before, result, "sbatch is not on PATH")


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="slurm-wlm is missing; `make test` installs it")
def test_a_slurm_controller_that_does_not_answer_is_found_before_the_disk_changes(project, tmp_path):
    """sbatch is installed but its controller is down: found before the last checkpoint goes, not
    once a fresh training removed it. A real `scontrol` against a controller address where nothing
    listens."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=down\nSlurmctldHost=node-a(127.0.0.1)\nSlurmctldPort={free_port()}\n"
                    f"AuthType=auth/munge\nAuthInfo=socket={tmp_path / 'munge.socket'}\n"
                    "NodeName=node-a NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN\n"
                    "PartitionName=main Nodes=node-a Default=YES State=UP\n")
    before = plant_previous_training(project, "ddp")
    params = (project / "params.yaml").read_text().replace("launcher: local", "launcher: slurm")
    params = params.replace("enabled: true\n  experiment", "enabled: false\n  experiment")
    (project / "slurm.yaml").write_text(params)
    result = train_cli(project, "ddp", "--params", "slurm.yaml", check=False, SLURM_CONF=str(conf))
    assert_refused_and_untouched(project, "ddp", before, result, "Slurm's controller does not answer",
                                 "is DOWN", "SLURM_CONF")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.fixture(scope="module")
def picky_server(tmp_path_factory):
    """A real `mlflow server` that only answers clients asking for another host name."""
    proc, uri, log = start_mlflow_server(tmp_path_factory.mktemp("picky"), "--allowed-hosts", "tracking.example:5000")
    yield uri
    stop_mlflow_server(proc, log)


def test_a_server_that_refuses_this_host_name_is_found_before_the_disk_changes(project, picky_server):
    before = plant_previous_training(project, "single")
    result = train_cli(project, "single", check=False, MLFLOW_TRACKING_URI=picky_server)
    assert_refused_and_untouched(project, "single", before, result, "--allowed-hosts")


def test_a_second_training_of_the_mode_is_refused_at_once_naming_the_first(project):
    # Long enough to outlast the second one's start on a loaded machine; stopped once it has spoken.
    params = (project / "params.yaml").read_text().replace("epochs: 2", "epochs: 200")
    (project / "long.yaml").write_text(params)
    first = subprocess.Popen(["mnist-pipeline", "train", "--mode", "single", "--params", "long.yaml"], cwd=project,
                             env=subprocess_env(**project_env(project)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lock = project / "models/single/.train.lock"
    deadline = time.monotonic() + scaled(120)
    while not (lock.is_file() and f"pid {first.pid} " in lock.read_text()):  # the file outlives its holders
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    started = time.monotonic()
    second = train_cli(project, "single", check=False)
    # A cold start of the command beside a training on both cores, far from the first's 200 epochs:
    # no wait for the first (which the poll() below checks is still running).
    assert time.monotonic() - started < scaled(120)
    assert second.returncode == 1, second.stderr
    assert "another training of this mode is running in this project (train --mode single, pid " \
           f"{first.pid}" in second.stderr, second.stderr
    assert first.poll() is None  # the first goes on, untouched
    first.send_signal(signal.SIGINT)  # Ctrl-C: it ends its runs FAILED and lets the lock go
    first.communicate(timeout=300)
    assert first.returncode != 0


@pytest.mark.parametrize("damage, message", [
    ("shape", "images are 27x27 pixels, the models take 28x28"),
    ("labels", "label(s) outside 0-9 (the first, at index 3, is 11)"),
])
def test_data_that_is_not_mnist_is_refused_at_prepare_with_checksums_off(tmp_path, damage, message):
    source = write_tiny_mnist(tmp_path / "idx")
    if damage == "shape":
        (source / "train-images-idx3-ubyte").write_bytes(idx_bytes([0] * 40 * 27 * 27, (40, 27, 27)))
    else:
        labels = [i % 10 for i in range(40)]
        labels[3] = 11
        (source / "train-labels-idx1-ubyte").write_bytes(idx_bytes(labels, (40,)))
    project = make_project(tmp_path / "proj", {"data": {"verify_checksums": False, "val_size": 10}})
    result = run(["mnist-pipeline", "prepare"], project, check=False, **project_env(project, MNIST_SOURCE=str(source)))
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (project / "data/prepared").exists()


def test_a_split_smaller_than_one_batch_is_trained_with_a_warning_naming_the_numbers(tmp_path, caplog):
    from pipeline.config import load_config
    from pipeline.prepared import save_prepared, split_train_val
    from pipeline.mnist import read_split
    from stages.train import check_prepared

    source = write_tiny_mnist(tmp_path / "idx")
    project = make_project(tmp_path / "proj", {"data": {"verify_checksums": False, "val_size": 10}})
    config = load_config(project / "params.yaml")
    train, files = read_split(source, "train", verify=False)
    test, test_files = read_split(source, "test", verify=False)
    from pipeline.prepared import describe

    train, val = split_train_val(train, config.data)
    splits = {"train": train, "val": val, "test": test}
    save_prepared(tmp_path / "prepared", splits, describe(splits, files + test_files, verified=False))
    with caplog.at_level(logging.WARNING):
        check_prepared(tmp_path / "prepared", batch_size=128)
    assert ("the training split has 30 samples (validation 10), fewer than one global batch "
            "(train.batch_size = 128)") in caplog.text


def test_out_never_replaces_a_folder_the_pipeline_did_not_make(project, mnist_dir, tmp_path):
    mine = tmp_path / "my-folder"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    for command in (["prepare", "--out", str(mine)], ["compare", "--out", str(mine)]):
        result = run(["mnist-pipeline", *command], project, check=False,
                     **project_env(project, MNIST_SOURCE=str(mnist_dir)))
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"{mine}: already holds files this stage did not write (thesis.tex)" in result.stderr
        assert (mine / "thesis.tex").read_text() == "years of work"


def test_out_replaces_its_own_folder_and_an_empty_one(project, mnist_dir, tmp_path):
    target = tmp_path / "prepared"
    target.mkdir()  # empty: fine
    env = project_env(project, MNIST_SOURCE=str(mnist_dir))
    for _ in range(2):  # the second time, the folder is the pipeline's own (marked)
        run(["mnist-pipeline", "prepare", "--out", str(target)], project, **env)
    assert (target / ".made-by-mnist-pipeline").is_file() and (target / "stats.json").is_file()


def plant_outbox(out: Path) -> None:
    (out / "tracking-outbox").mkdir(parents=True, exist_ok=True)
    (out / "tracking-outbox/rank-0.jsonl").write_text(
        '{"op":"end","run":"0123456789abcdef0123456789abcdef","status":"FINISHED"}\n')


def test_calls_a_finished_training_never_sent_are_not_dropped_by_the_next(project):
    """The last training finished (no unfinished.json) but its runs' end never reached the store
    (an outage, a refusal): a fresh start would drop what send-runs can still deliver."""
    out = project / "models/single"
    before = plant_previous_training(project, "single")
    plant_outbox(out)
    before = digests(out)
    result = train_cli(project, "single", check=False)
    assert_refused_and_untouched(project, "single", before, result,
                                 "models/single/tracking-outbox: 1 tracking calls of the last training",
                                 "`mnist-pipeline send-runs --mode single`", "--discard")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    run(["mnist-pipeline", "send-runs", "--mode", "single", "--discard"], project, **project_env(project))
    train_cli(project, "single")  # the way on works


def test_an_interrupted_training_that_starts_afresh_drops_its_outbox_saying_so(project):
    """Its runs end FAILED, so what it kept for them is not replayed into the new training's."""
    out = project / "models/single"
    plant_outbox(out)
    (out / "checkpoint.pt").unlink(missing_ok=True)
    (out / "unfinished.json").write_text('{"inputs": "an earlier one", "settings": {}}')
    result = train_cli(project, "single")
    assert "single: dropped 1 tracking calls an earlier training kept in models/single/tracking-outbox" in result.stderr
    assert not (out / "tracking-outbox").exists() and "tracking server unreachable" not in result.stderr


@pytest.mark.parametrize("changed", [{"eval_batch_size": 250}, {"nproc": 1}])
def test_an_interrupted_training_goes_on_only_under_every_setting_it_started_with(project, changed):
    """Not only the trajectory's: a setting that changes any output (the world size in the
    results, the evaluation batch) starts the training afresh instead of taking the old outputs."""
    crashed = train_cli(project, "single", check=False, MNIST_PIPELINE_CRASH_AFTER_EPOCH="1")
    assert crashed.returncode != 0 and (project / "models/single/unfinished.json").is_file(), crashed.stderr[-2000:]
    other = project / "other.yaml"
    settings = yaml.safe_load((project / "params.yaml").read_text())
    settings["train"].update(changed)
    other.write_text(yaml.safe_dump(settings))
    again = train_cli(project, "single", "--params", str(other))
    [(key, value)] = changed.items()
    assert "cannot go on: its settings changed (train." + key in again.stderr, again.stderr[-2000:]
    assert f"-> {value!r}" in again.stderr and "single epoch 1/2" in again.stderr
    assert not (project / "models/single/unfinished.json").exists()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a read-only folder")
def test_a_read_only_artifact_store_is_found_before_the_disk_changes(project):
    """A refusal is not an outage: no training, and no 120 s wait, for a store that will never
    take the files."""
    before = plant_previous_training(project, "single")
    (project / "mlartifacts").mkdir(exist_ok=True)
    result = subprocess.run(["unshare", "--mount", "sh", "-c",
                             "mount -t tmpfs -o ro tmpfs mlartifacts && exec mnist-pipeline train --mode single"],
                            cwd=project, env=subprocess_env(**project_env(project)), capture_output=True, text=True)
    assert_refused_and_untouched(project, "single", before, result,
                                 "mlartifacts: the MLflow artifact folder cannot be written", "Read-only file system")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_deleted_experiment_is_found_before_the_disk_changes(project, tmp_path):
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'deleted.db'}"
    client = MlflowClient(store)
    client.delete_experiment(client.create_experiment("mnist-data-parallel",
                                                      tags={"mlflow.experimentKind": "custom_model_development"}))
    before = plant_previous_training(project, "single")
    result = train_cli(project, "single", check=False, MLFLOW_TRACKING_URI=store)
    assert_refused_and_untouched(project, "single", before, result, "'mnist-data-parallel' is deleted",
                                 "mlflow experiments restore")


def test_a_store_another_process_is_writing_delays_the_start_not_fails_it(tmp_path):
    """SQLite answers "database is locked" at once, without its busy timeout, when a connection
    switches to WAL while another process writes (an `mlflow ui` making a fresh store's tables)."""
    from pipeline.tracking.store import check_store

    store = tmp_path / "mlflow.db"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"db = sqlite3.connect({str(store)!r}, isolation_level=None)\n"
        "db.execute('BEGIN IMMEDIATE'); db.execute('CREATE TABLE being_made (x)')\n"
        # The moment it lets go, on the clock every process shares: what the check must wait for.
        "print('writing', flush=True); time.sleep(2); print(time.monotonic(), flush=True); db.execute('COMMIT')\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        check_store(f"sqlite:///{store}")
        returned = time.monotonic()
        let_go = float(writer.stdout.readline())
    finally:
        writer.kill()
        writer.wait()
    assert returned > let_go  # it did meet the lock, and waited it out
    assert sqlite3.connect(store).execute("PRAGMA journal_mode").fetchone() == ("wal",)


@pytest.mark.parametrize("damage", ["store", "stats"])
def test_a_damaged_store_or_data_file_is_one_line_naming_it_and_the_disk_is_kept(project, tmp_path, damage):
    before = plant_previous_training(project, "single")
    env = {}
    if damage == "store":
        (tmp_path / "mlflow.db").write_bytes(b"not a database, whatever its name says" * 100)
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
        expected = f"{tmp_path / 'mlflow.db'} is not a usable SQLite database"
    else:
        shutil.copytree(project / "data/prepared", tmp_path / "prepared")
        (tmp_path / "prepared/stats.json").write_text('{"splits": {"train": ')
        env = {}
        expected = f"{tmp_path / 'prepared/stats.json'}: damaged, not valid JSON"
    args = ["--data-dir", str(tmp_path / "prepared")] if damage == "stats" else []
    result = train_cli(project, "single", *args, check=False, **env)
    assert_refused_and_untouched(project, "single", before, result, expected)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_rendezvous_error_reaches_the_user_as_one_line_naming_the_rank():
    from datetime import timedelta

    from torch.distributed import TCPStore

    from stages.cli import library_failure

    try:
        TCPStore("127.0.0.1", free_port(), is_master=False, timeout=timedelta(seconds=1))
    except Exception as exc:  # what torch.distributed raises when the rendezvous is not there
        os.environ.update(RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        try:
            message = library_failure(exc)
        finally:
            for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(key)
    assert message.startswith("rank 1: torch.distributed could not reach the other ranks through 127.0.0.1:1")
    assert "\n" not in message and "MNIST_PIPELINE_DEBUG=1" in message


# As NCCLUtils.hpp's C10D_NCCL_CHECK words it (torch 2.14), for the failure a container without
# --ipc=host meets at 8 ranks: NCCL cannot make its shared-memory segment in a 64 MB /dev/shm.
NCCL_SHM_FAILURE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3690, unhandled system error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.7\nncclSystemError: System call (e.g. socket, "
    "malloc) or external library call failed or device error. \nLast error:\nError while creating shared memory "
    "segment /dev/shm/nccl-Yc3QmB (size 9637888)")


def test_an_nccl_failure_is_named_as_one_with_its_likely_cause():
    """torch raises NCCL's failures as DistBackendError, from torch.distributed like a rendezvous
    error: they must not read "could not reach the other ranks"."""
    from torch.distributed import DistBackendError

    from stages.cli import library_failure

    os.environ["RANK"] = "5"
    try:
        message = library_failure(DistBackendError(NCCL_SHM_FAILURE))
    finally:
        os.environ.pop("RANK")
    assert message.startswith("rank 5: NCCL failed (unhandled system error: Error while creating shared memory "
                              "segment /dev/shm/nccl-Yc3QmB (size 9637888))"), message
    assert "--ipc=host" in message and "--shm-size" in message, message
    assert "NCCL_DEBUG=WARN" in message and "could not reach the other ranks" not in message
    assert "\n" not in message
    # NCCL words every failed system call so: a socket between nodes is not blamed on /dev/shm.
    socket = NCCL_SHM_FAILURE.replace("Error while creating shared memory segment /dev/shm/nccl-Yc3QmB (size 9637888)",
                                      "socketPollConnect: connect to 10.0.0.2<41234> returned Connection refused")
    message = library_failure(DistBackendError(socket))
    assert "Connection refused" in message and "NCCL_SOCKET_IFNAME" in message and "--shm-size" not in message


def test_an_nccl_setup_timeout_is_named_as_one_not_as_an_unreachable_rendezvous():
    """C10D_CHECK_TIMEOUT's words (NCCLUtils.hpp, checked against the library), where a communicator
    set up without blocking timed out: a rank that did not join, not an address "?:?"."""
    import torch
    from torch.distributed import DistBackendError

    from stages.cli import library_failure

    assert b"NCCL timeout in: " in (Path(torch.__file__).parent / "lib" / "libtorch_cuda.so").read_bytes()
    os.environ["RANK"] = "3"
    try:
        message = library_failure(DistBackendError(
            "NCCL timeout in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:232"))
    finally:
        os.environ.pop("RANK")
    assert message.startswith("rank 3: NCCL failed (NCCL's communicator setup timed out): a rank did not join in "
                              "time"), message
    assert "could not reach" not in message and "?:?" not in message and "\n" not in message


def test_a_setting_only_ddp_cannot_use_fails_the_first_mode(project):
    """With ddp in train.modes, train@single refuses a global batch smaller than DDP's ranks: found
    in seconds, not after single and dp have trained."""
    before = plant_previous_training(project, "single")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(batch_size=2, nproc=3, modes=["single", "dp", "ddp"])
    (project / "params-tiny-batch.yaml").write_text(yaml.safe_dump(params))
    result = train_cli(project, "single", "--params", "params-tiny-batch.yaml", check=False)
    assert_refused_and_untouched(project, "single", before, result,
                                 "ddp (in train.modes): train.batch_size = 2 is smaller than the 3 DDP ranks")


def test_a_compile_this_machine_cannot_build_is_refused_before_the_disk_changes(project):
    """train.compile without the C++ compiler TorchInductor builds its CPU kernels with: one line at
    the start, not a compiler error from the first step of every rank. With it, the stage trains
    compiled and logs its model as any (dp on a CPU: the bare module, compiled whole)."""
    before = plant_previous_training(project, "dp")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["compile"] = True
    (project / "params-compile.yaml").write_text(yaml.safe_dump(params))
    result = train_cli(project, "dp", "--params", "params-compile.yaml", check=False, CXX="no-such-compiler")
    assert_refused_and_untouched(project, "dp", before, result,
                                 "train.compile is true, but this machine has no C++ compiler 'no-such-compiler'")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    result = train_cli(project, "dp", "--params", "params-compile.yaml")
    assert re.search(r"dp: torch.compile \(train.compile\): [1-9]\d* graph\(s\) compiled on rank 0",
                     result.stdout + result.stderr), result.stderr[-3000:]
    assert json.loads((project / "models/dp/mlflow_run.json").read_text())


@pytest.mark.parametrize("content, said", [
    ("weights", "a bare state_dict of 2 tensors: weights only, no optimizer, schedule or epoch"),
    ("lightning", "a dict of state_dict, epoch, global_step, without model, optimizer, scheduler, history, trajectory"),
])
def test_a_checkpoint_written_by_other_code_is_said_so(project, content, said):
    """Not "the settings changed since the checkpoint": it never had ours."""
    import torch

    out = project / "models/single"
    out.mkdir(parents=True, exist_ok=True)
    weights = {"fc.weight": torch.zeros(2, 2), "fc.bias": torch.zeros(2)}
    torch.save(weights if content == "weights" else {"state_dict": weights, "epoch": 3, "global_step": 30},
               out / "checkpoint.pt")
    before = digests(out)
    result = train_cli(project, "single", "--resume", check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"models/single/checkpoint.pt: not a checkpoint of this pipeline ({said}); move it away" in result.stderr
    assert "settings changed" not in result.stderr and "Traceback" not in result.stderr
    assert digests(out) == before


def test_a_record_of_another_training_s_complete_outputs_does_not_keep_this_model_from_its_run(project):
    """An outer launcher (torchrun, a scheduler) runs the workers without this command's record
    keeping: a record left by an earlier training names that one's run, so this one's model is
    still logged to its own."""
    from mlflow import MlflowClient

    out = project / "models/single"
    out.mkdir(parents=True, exist_ok=True)
    (out / "unfinished.json").write_text('{"inputs": "x", "settings": {}, "outputs_complete": "0123abcd"}')
    train_cli(project, "single", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    parent = json.loads((out / "mlflow_run.json").read_text())["parent"]
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_run(parent).info.experiment_id
    assert [m.source_run_id for m in client.search_logged_models([experiment]) if m.source_run_id == parent] == [parent]
    (out / "unfinished.json").unlink()
