"""DDP workers start as forks of the fork server the CLI starts before it imports torch
(pipeline.runtime.forkserver), which imports what they need meanwhile; the CLI starts it only for a
command that will launch workers on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from stages.cli import launches_local_workers
from tests.conftest import (REFUSE_CUDA, ROOT, SMALL, ddp_worker_pids, make_project, prepare, project_env, run,
                            subprocess_env)


@pytest.fixture
def params(tmp_path, monkeypatch):
    """Write params.yaml (params.yaml's own keys, with `train` overridden) in a fresh folder."""
    monkeypatch.chdir(tmp_path)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DVC_STAGE"):
        monkeypatch.delenv(key, raising=False)

    def write(**train) -> Path:
        settings = yaml.safe_load((ROOT / "params.yaml").read_text())
        settings["train"].update(train)
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(settings))
        return path

    return write


def test_the_cli_starts_the_fork_server_for_a_local_ddp_launch_only(params, monkeypatch):
    params(modes=["single", "dp", "ddp"])
    assert launches_local_workers("train", ["--mode", "ddp"])
    assert launches_local_workers("train", ["--mode=ddp"])
    assert launches_local_workers("commcheck", [])
    assert not launches_local_workers("train", ["--mode", "single"])
    assert not launches_local_workers("evaluate", [])
    monkeypatch.setenv("DVC_STAGE", "train@ddp")
    assert launches_local_workers("train", ["--mode-of-dvc-stage"])
    monkeypatch.setenv("DVC_STAGE", "train@dp")
    assert not launches_local_workers("train", ["--mode-of-dvc-stage"])
    other = params(modes=["single"])  # another file, named by --params
    other.rename(other.with_name("other.yaml"))
    params(modes=["single", "ddp"])
    assert not launches_local_workers("commcheck", ["--params", "other.yaml"])  # nothing uses torch.distributed
    assert launches_local_workers("commcheck", ["--params", "params.yaml"])
    params(modes=["ddp"], launcher="slurm")
    assert not launches_local_workers("train", ["--mode", "ddp"])  # sbatch starts them, on other machines
    params(modes=["ddp"])
    monkeypatch.setenv("RANK", "0")
    assert not launches_local_workers("train", ["--mode", "ddp"])  # a worker of an outer torchrun
    monkeypatch.delenv("RANK")
    Path("params.yaml").write_text("train: [")
    assert not launches_local_workers("train", ["--mode", "ddp"])  # the command reports the broken file


def test_ddp_workers_are_forks_of_the_preloaded_server(tmp_path, mnist_dir):
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "epochs": 500}})
    prepare(project, mnist_dir)
    launcher = subprocess.Popen(["mnist-pipeline", "train", "--mode", "ddp"], cwd=project, text=True,
                                env=subprocess_env(**project_env(project)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    try:
        deadline, workers = time.monotonic() + 180, {}
        while time.monotonic() < deadline and len(workers) < 2 and launcher.poll() is None:
            time.sleep(0.5)
            workers = ddp_worker_pids(launcher.pid)
        assert sorted(workers) == [0, 1], launcher.stderr.read() if launcher.poll() is not None else workers
        servers = {parent_of(pid) for pid in workers.values()}
        assert len(servers) == 1  # one server for both ranks...
        server = servers.pop()
        assert parent_of(server) == launcher.pid  # ...which the command started
        command = Path(f"/proc/{server}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "multiprocessing.forkserver" in command and "'pipeline.runtime.preloaded'" in command, command
        # A session of its own too: a signal to the launcher's process group (a closed terminal,
        # `timeout`) leaves it alive, and through it the agent still sees and stops the workers.
        assert os.getsid(server) == server
        # The workers run what the server imported: torch is mapped, not loaded anew, in each.
        for pid in workers.values():
            assert "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
            assert Path(f"/proc/{pid}/cmdline").read_bytes() == Path(f"/proc/{server}/cmdline").read_bytes()
            assert os.getsid(pid) == pid  # a session of its own, as torchrun's agent gives the workers it execs
        # The launcher killed outright (the OOM killer): the server, then every worker, goes too.
        launcher.kill()
        launcher.communicate(timeout=60)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in [server, *workers.values()]):
            time.sleep(0.5)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    left = [pid for pid in [server, *workers.values()] if Path(f"/proc/{pid}").exists()
            and "zombie" not in Path(f"/proc/{pid}/status").read_text()]
    assert not left, "outlived the launcher: " + ", ".join(str(pid) for pid in left)


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


NO_CUDA_IN_THE_SERVER = REFUSE_CUDA + """
from stages.common import WORKER_PRELOAD as PRELOAD
for modules in PRELOAD.values():
    for module in modules:
        __import__(module)
print("calls:", calls)
"""


def test_what_the_fork_server_imports_never_touches_cuda():
    """The server must leave CUDA untouched: the CUDA driver cannot be used in a fork of a process
    that initialised it. On a machine without a GPU this is what can be checked: nothing imported
    calls into torch's CUDA runtime (device count, init, current device), not even through
    torch.cuda.is_available()."""
    done = subprocess.run([sys.executable, "-c", NO_CUDA_IN_THE_SERVER], cwd=ROOT, capture_output=True, text=True,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("calls: []"), done.stdout


def test_a_bug_in_a_worker_shows_its_traceback():
    """A worker's uncaught exception (a bug, CUDA running out of memory) is reported as a fresh
    interpreter would report it: torch's worker wrapper only files it for the agent, and the
    agent's own traceback of it is dropped (pipeline.parallel.launch_workers)."""
    code = ("import multiprocessing, tempfile\n"
            "from pipeline import parallel\nfrom pipeline.runtime import forkserver\n"
            "from stages import workers\n"
            "multiprocessing.set_forkserver_preload(['tests.boom_stage'])\n"
            "parallel.launch_workers(1, forkserver.run_named, [workers.WORKER_ENTRY, tempfile.mkdtemp(), 'boom'])\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert done.returncode != 0
    assert "ddp worker(s) failed: rank 0 (exit code 1)" in done.stderr, done.stderr[-3000:]
    assert "in boom\n    print(1 / 0)" in done.stderr and "ZeroDivisionError: division by zero" in done.stderr, \
        done.stderr[-3000:]
    # A worker taken down by SIGABRT (NCCL's watchdog, past any Python handler) has its likely cause named.
    aborted = subprocess.run([sys.executable, "-c", code.replace("'boom'])", "'boom', '--abort'])")], cwd=ROOT,
                             capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert ("ddp worker(s) failed: rank 0 (exit code -6: SIGABRT, an abort in C++; on GPUs most often NCCL's "
            "watchdog") in aborted.stderr, aborted.stderr[-3000:]
