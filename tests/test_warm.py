"""Under DVC, every stage runs as a fork of one warm server (pipeline/runtime/warm.py, pipeline/runtime/warm_server.py)
and must be the command a fresh process would have run: the same outputs, messages, exit codes
and signals, DDP workers forked without importing anything anew, nothing on CUDA before a fork,
and a new server wherever a fresh process would read something else."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from mlflow import MlflowClient

from pipeline.runtime import warm, warm_server
from stages.entry import PACKAGES, WARM_APP
from tests.conftest import (REFUSE_CUDA, ROOT, SMALL, build_stand_in_driver, ddp_worker_pids, first_epoch_run,
                            make_project, prepare, project_env, run, scaled, subprocess_env)

def servers_for(project: Path) -> list[int]:
    """The warm servers started in this project's folder or below: `mnist-pipeline warm-server
    FOLDER` in `ps` (or, the moment before it names itself, the command line it started with)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().rstrip(b"\0").split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if args[:2] == [b"mnist-pipeline", b"warm-server"] or warm.SERVER_CODE.encode() in args:
            folder = Path(os.fsdecode(args[-1]))
            if folder == project or project in folder.parents:
                found.append(int(proc.name))
    return found


def children_of(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def listening_address(pid: int) -> str:
    """The path of the socket the server listens on (the listening one among its descriptors)."""
    inodes = {os.readlink(fd).removeprefix("socket:[").removesuffix("]") for fd in Path(f"/proc/{pid}/fd").iterdir()
              if os.readlink(fd).startswith("socket:[")}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[6] in inodes and fields[3] == "00010000" and len(fields) > 7:  # __SO_ACCEPTCON: listening
            return fields[7]
    raise AssertionError(f"no listening socket of process {pid} in /proc/net/unix")


def stop_servers(project: Path) -> None:
    for pid in servers_for(project):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def project(tmp_path_factory, mnist_dir):
    project = make_project(tmp_path_factory.mktemp("warm") / "proj", SMALL)
    prepare(project, mnist_dir)
    yield project
    stop_servers(project)


@pytest.fixture
def served(project):
    """The module's project, with no warm server of its own, nor a training, left over from another test."""
    stop_servers(project)
    shutil.rmtree(project / "models", ignore_errors=True)
    yield project
    stop_servers(project)


@contextmanager
def long_training(project: Path, mode: str, **popen) -> Iterator[subprocess.Popen]:
    """The client of `train --mode MODE` for 500 epochs, through the warm server: each test stops
    it, and whatever the test left running is killed."""
    params = project / "long.yaml"
    params.write_text((project / "params.yaml").read_text().replace("epochs: 2", "epochs: 500"))
    client = subprocess.Popen(["mnist-pipeline", "train", "--mode", mode, "--params", str(params)], cwd=project,
                              env=warm_env(project), text=True, **popen)
    try:
        yield client
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate()


def warm_env(project: Path, **extra: str) -> dict[str, str]:
    return subprocess_env(**project_env(project, MNIST_PIPELINE_WARM="1", MNIST_PIPELINE_DEBUG="1", **extra))


@pytest.mark.fast
def test_a_dvc_repro_runs_every_stage_but_the_first_in_one_server(tmp_path, mnist_dir, stand_in_driver):
    """On a host with an NVIDIA driver (the stand-in: no device the CUDA runtime can use) too, which
    `import torch` loads: the server never calls into it, each stage's fork does as it needs. Every
    stage with ddp alone in train.modes (its workers forked too): the fast tier's `dvc repro` stays
    short; every mode's is tests/test_dvc_pipeline.py's, which checks the same of its stages."""
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "modes": ["ddp"]}})
    log = tmp_path / "driver-calls"
    try:
        env = subprocess_env(**project_env(project, MNIST_SOURCE=str(mnist_dir), MNIST_PIPELINE_DEBUG="1",
                                           LD_LIBRARY_PATH=str(stand_in_driver), STAND_IN_CUDA_LOG=str(log)))
        # One stream, as `make gpu-check` reads it: each stage's lines after DVC's "Running stage".
        done = subprocess.run(["dvc", "repro"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:]
        # prepare runs in its own process while the server imports beside it; every later stage,
        # whatever DVC wrote in between, finds that same server (one key for the whole run).
        fallbacks = [line for line in done.stdout.splitlines()
                     if "running in this process" in line]
        assert fallbacks == ["mnist-pipeline: running in this process: the server starts beside this command, "
                             "for the stages after it"], done.stdout[-3000:]
        # What `make gpu-check` reports of the same output on a GPU host.
        from scripts.gpu_check import warm_row

        name, outcome, detail = warm_row(done.stdout)
        assert outcome == "passed" and "prepare: own process" in detail and "train@ddp: warm" in detail, detail
        servers = set(re.findall(r"a fork of the warm server \(process (\d+)\)", done.stdout))
        assert len(servers) == 1, done.stdout[-3000:]
        # It was started for this `dvc repro`, and ends soon after it, not after its idle time (30 s).
        (server,) = servers
        calls = [line.split() for line in log.read_text().splitlines()]
        # The forks used the driver (train.device: auto); the server only asked whether it was
        # initialised (pipeline/runtime/driver.py), which initialises nothing.
        assert {pid for pid, _ in calls} - {server}, calls
        assert {call for pid, call in calls if pid == server} <= {"cuDeviceGetCount", "nvmlDeviceGetCount_v2"}, calls
        # Well before the idle time ends it (30 s after the last command), on a busy host too.
        deadline = time.monotonic() + warm_server.LINGER_S + 20
        while alive(int(server)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(int(server)) and not servers_for(project)
        stages = re.findall(r"Running stage '([^']+)'", done.stdout)
        assert stages == ["prepare", "commcheck", "train@ddp", "evaluate", "compare"], stages
        assert (project / "models/ddp/model.pt").is_file() and (project / "reports/comparison.md").is_file()
    finally:
        stop_servers(project)


def test_a_fork_is_the_command_a_fresh_process_would_run(served):
    """Its own working directory, stage variables, output and exit code; the server holds none
    of the client's files (a caller reading the output to its end is not kept waiting)."""
    project = served
    env = warm_env(project, MNIST_PIPELINE_WARM_IDLE_S="600")
    for stage in ("train@bogus", "train@nothing"):
        done = subprocess.run(["mnist-pipeline", "train", "--mode-of-dvc-stage"], cwd=project / "data",
                              env={**env, "DVC_STAGE": stage}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1
        assert f"DVC_STAGE={stage!r}: --mode-of-dvc-stage needs a stage train@<mode>" in done.stderr, done.stderr
        assert "running in this process" not in done.stderr  # the server ran it
    servers = servers_for(project)
    assert len(servers) == 1 and alive(servers[0])  # ...and is still there: the output closed without it
    # A relative --params is read from the client's directory, not the server's (/).
    (project / "data" / "here.yaml").write_text("train: {epochs: 0}\n")
    done = subprocess.run(["mnist-pipeline", "train", "--mode", "single", "--params", "here.yaml"],
                          cwd=project / "data", env={**env, "MNIST_PIPELINE_DEBUG": "0"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and "here.yaml: train.epochs" in done.stderr, done.stderr
    # Exit codes and messages as the same command run in a process of its own.
    cold = subprocess.run(["mnist-pipeline", "train", "--mode", "single", "--params", "here.yaml"],
                          cwd=project / "data", env={**env, "MNIST_PIPELINE_DEBUG": "0", "MNIST_PIPELINE_WARM": "0"},
                          capture_output=True, text=True, timeout=300)
    assert (cold.returncode, cold.stdout, cold.stderr.replace("\n", "")) == \
        (done.returncode, done.stdout, done.stderr.replace("\n", ""))


def test_signals_reach_the_ddp_training_and_its_workers_are_forks_of_forks(served):
    """Ctrl-C at the client stops the training in the server's fork as it stops one in the
    client's own process: every run ends FAILED, the client exits as interrupted, nothing stays.
    The DDP fork server is a fork of that fork: the workers run the warm server's code, not a
    fresh `python -c from multiprocessing.forkserver ...`."""
    project = served
    with long_training(project, "ddp", stdout=subprocess.PIPE, stderr=subprocess.PIPE) as client:
        parent = first_epoch_run(project, "ddp", client, timeout=300)
        assert parent is not None, client.communicate()[1][-3000:] if client.poll() is not None else "no epoch"
        (server,) = servers_for(project)
        forks = [pid for pid in children_of(server) if alive(pid)]
        assert len(forks) == 1
        workers = ddp_worker_pids(forks[0])
        assert sorted(workers) == [0, 1]
        # Each shows in `ps` as its command (written over the server's command line), the workers too.
        for pid in [forks[0], *workers.values()]:
            assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:4] == \
                [b"mnist-pipeline", b"train", b"--mode", b"ddp"]
            assert Path(f"/proc/{pid}/comm").read_text().strip() == "mnist-pipeline"
        found = subprocess.run(["pgrep", "-f", "^mnist-pipeline train --mode ddp"], capture_output=True, text=True)
        assert {forks[0], *workers.values()} <= {int(pid) for pid in found.stdout.split()}  # and the DDP fork server
        assert Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")[:3] == \
            [b"mnist-pipeline", b"warm-server", str(project).encode()]
        client.send_signal(signal.SIGINT)
        _, stderr = client.communicate(timeout=120)
    assert client.returncode in (130, -signal.SIGINT), stderr[-3000:]  # the launcher's exit on Ctrl-C
    runs = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_runs([parent.info.experiment_id],
                                                                         "attributes.run_name LIKE 'ddp%'")
    assert {r.info.run_name: r.info.status for r in runs} == \
        {"ddp": "FAILED", "ddp/rank-0": "FAILED", "ddp/rank-1": "FAILED"}, stderr[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(alive(pid) for pid in [*forks, *workers.values()]):
        time.sleep(0.5)
    assert not [pid for pid in [*forks, *workers.values()] if alive(pid)]


def test_a_client_killed_outright_takes_its_command_with_it(served):
    """And a signal the client was started ignoring (nohup's SIGHUP) is ignored by the command
    too, as a fresh process would inherit it."""
    project = served
    with long_training(project, "single", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) as client:
        assert first_epoch_run(project, "single", client, timeout=300) is not None
        (server,) = servers_for(project)
        forks = [pid for pid in children_of(server) if alive(pid)]
        assert len(forks) == 1
        ignored = next(line for line in Path(f"/proc/{forks[0]}/status").read_text().splitlines()
                       if line.startswith("SigIgn:"))
        assert int(ignored.split()[1], 16) & (1 << (signal.SIGHUP - 1)), ignored
        os.killpg(forks[0], signal.SIGHUP)
        client.send_signal(signal.SIGHUP)
        time.sleep(2)
        assert client.poll() is None and alive(forks[0])
        # Ctrl-Z stops the command with its client (the fork's group is not orphaned), fg resumes both.
        client.send_signal(signal.SIGTSTP)
        assert wait_for_state(client.pid, "T") and wait_for_state(forks[0], "T")
        client.send_signal(signal.SIGCONT)
        assert wait_for_state(client.pid, "S", "R") and wait_for_state(forks[0], "S", "R")
        client.kill()
        client.communicate(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and alive(forks[0]):
            time.sleep(0.2)
        assert not alive(forks[0])
        time.sleep(1)
        assert servers_for(project) == [server]  # it reaped the fork and serves on


def test_a_job_wide_sigterm_ends_the_runs_failed(served):
    """`scancel`, `systemctl stop`: SIGTERM reaches the client and the command at once, and the
    client passes it on too; the second must not cut short the first's cleanup."""
    project = served
    with long_training(project, "single", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as client:
        parent = first_epoch_run(project, "single", client, timeout=300)
        assert parent is not None
        (server,) = servers_for(project)
        (fork,) = [pid for pid in children_of(server) if alive(pid)]
        os.killpg(fork, signal.SIGTERM)
        client.send_signal(signal.SIGTERM)
        _, stderr = client.communicate(timeout=120)
    assert client.returncode in (143, -signal.SIGTERM), stderr[-2000:]
    store = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    ranks = store.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert ranks and {run.info.status for run in [store.get_run(parent.info.run_id), *ranks]} == {"FAILED"}


def test_a_stopped_command_whose_server_dies_still_ends_its_runs(served):
    """Ctrl-Z, then the server is killed: the kernel hangs up the command's orphaned, stopped
    group (SIGHUP, SIGCONT); the command ends as SIGTERM ends it, its run FAILED, not RUNNING. The
    command is one a terminal started, SIGHUP not ignored, whatever the suite runs under (`nohup
    make test`: a command started ignoring SIGHUP rightly ignores it, as
    test_a_client_killed_outright_takes_its_command_with_it shows)."""
    project = served
    with long_training(project, "single", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL)) as client:
        parent = first_epoch_run(project, "single", client, timeout=300)
        assert parent is not None
        (server,) = servers_for(project)
        (fork,) = [pid for pid in children_of(server) if alive(pid)]
        client.send_signal(signal.SIGTSTP)
        assert wait_for_state(client.pid, "T") and wait_for_state(fork, "T", every_thread=True)
        session = os.getsid(server)
        os.kill(server, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and alive(fork):
            time.sleep(0.2)
        assert not alive(fork), process_facts(fork, session)
        client.send_signal(signal.SIGCONT)
        _, stderr = client.communicate(timeout=60)
    assert client.returncode == 1 and "is not known" in stderr, stderr[-2000:]
    run = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_run(parent.info.run_id)
    assert run.info.status == "FAILED"


def process_facts(pid: int, session: int) -> str:
    """What a process still alive is doing, for a failure's message: its state and signals, its
    session and group against the server's session, its parent, and where each thread waits."""
    try:
        status = {line.split(":", 1)[0]: line.split(":", 1)[1].strip()
                  for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line}
        parent = int(status["PPid"])
        threads = {task.name: (task / "wchan").read_text() + "/" + (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                   for task in Path(f"/proc/{pid}/task").iterdir()}
        return (f"state {status['State']}, pending {status['SigPnd']}/{status['ShdPnd']}, blocked {status['SigBlk']}, "
                f"ignored {status['SigIgn']}, caught {status['SigCgt']}; sid {os.getsid(pid)} pgid {os.getpgid(pid)} "
                f"(server's sid {session}); parent {parent} sid {os.getsid(parent)} "
                f"{Path(f'/proc/{parent}/cmdline').read_bytes()[:120]!r}; threads {threads}")
    except (OSError, KeyError, ValueError) as exc:
        return f"(gone or unreadable: {exc})"


def wait_for_state(pid: int, *states: str, timeout: float = 20, every_thread: bool = False) -> bool:
    """Whether the process (with `every_thread`, each of its threads) reaches one of `states`. A
    stop is the process's only once every thread has stopped: a thread still in a write (state D)
    holds the group stop open, and the kernel hangs up only groups whose stop is complete."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks = sorted(Path(f"/proc/{pid}/task").iterdir()) if every_thread else [Path(f"/proc/{pid}")]
        try:
            found = [next(line for line in (task / "status").read_text().splitlines()
                          if line.startswith("State:")).split()[1] for task in tasks]
        except FileNotFoundError:  # a thread ended meanwhile
            continue
        if all(state in states for state in found):
            return True
        time.sleep(0.1)
    return False


def test_a_server_that_dies_leaves_its_command_running_and_its_client_failing(served):
    """The server killed under a running command (the OOM killer): the command goes on, the client
    still passes signals on and waits for it, then fails, since how it ended went with the server."""
    project = served
    with long_training(project, "single", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as client:
        parent = first_epoch_run(project, "single", client, timeout=300)
        assert parent is not None
        (server,) = servers_for(project)
        (fork,) = [pid for pid in children_of(server) if alive(pid)]
        os.kill(server, signal.SIGKILL)
        time.sleep(2)
        assert client.poll() is None and alive(fork)
        client.send_signal(signal.SIGINT)
        _, stderr = client.communicate(timeout=120)
    assert client.returncode == 1
    assert "the warm server ended while `train --mode single" in stderr and "is not known" in stderr, stderr[-2000:]
    assert not alive(fork)
    run = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_run(parent.info.run_id)
    assert run.info.status == "FAILED"  # the command ended as Ctrl-C ends it


def test_a_stopped_server_takes_no_new_command_and_lets_the_running_one_end(served):
    """SIGTERM to the server (`kill PID`): the running command goes on and its client still learns
    how it ended; a new command goes to a new server; then the stopped server exits."""
    project = served
    with long_training(project, "single", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as client:
        assert first_epoch_run(project, "single", client, timeout=300) is not None
        (server,) = servers_for(project)
        os.kill(server, signal.SIGTERM)
        time.sleep(1)
        assert alive(server) and client.poll() is None
        other = subprocess.run(["mnist-pipeline", "train", "--mode", "single", "--params", "missing.yaml"],
                               cwd=project, env=warm_env(project), capture_output=True, text=True, timeout=300)
        # Its name is free: the new command starts a server of its own and runs there.
        assert other.returncode == 1 and "missing.yaml: not found" in other.stderr, other.stderr
        assert "running in this process" not in other.stderr and len(servers_for(project)) == 2
        client.send_signal(signal.SIGINT)
        _, stderr = client.communicate(timeout=120)
    assert client.returncode != 0 and "is not known" not in stderr, stderr[-2000:]  # told how it ended
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and alive(server):
        time.sleep(0.2)
    assert not alive(server)


def test_a_frozen_server_is_passed_over_within_seconds(served):
    """A server stopped by SIGSTOP (a debugger, a job control mistake) would never answer: a new
    command sees it stopped, says so under MNIST_PIPELINE_DEBUG and runs in its own process, not
    after START_TIMEOUT_S in silence."""
    project = served
    env = warm_env(project, MNIST_PIPELINE_WARM_IDLE_S="120")
    command = ["mnist-pipeline", "train", "--mode", "single", "--params", "missing.yaml"]
    first = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 1 and "running in this process" not in first.stderr, first.stderr
    (server,) = servers_for(project)
    os.kill(server, signal.SIGSTOP)
    try:
        started = time.monotonic()
        other = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - started
    finally:
        os.kill(server, signal.SIGCONT)
    assert other.returncode == 1 and "missing.yaml: not found" in other.stderr, other.stderr
    assert f"running in this process: the warm server (process {server}) is stopped" in other.stderr, other.stderr
    assert took < scaled(60)  # a cold start of the command, not the server's START_TIMEOUT_S


def test_a_command_longer_than_the_idle_time_leaves_its_server_serving(served):
    """Idle counts from the end of the last command, not its start: a training longer than the
    idle time (or, once its `dvc repro`'s processes are gone, the linger) must not end the server
    under the next stage, which would then wait for a new server's imports."""
    project = served
    params = project / "long.yaml"
    params.write_text((project / "params.yaml").read_text().replace("epochs: 2", "epochs: 500"))
    # The next command must reach the server within it: a process start, on a busy day too. The
    # bug this catches (idle counted from a command's start) ends the server whatever its length.
    idle = scaled(10)
    env = warm_env(project, MNIST_PIPELINE_WARM_IDLE_S=f"{idle:g}")
    client = subprocess.Popen(["mnist-pipeline", "train", "--mode", "single", "--params", str(params)], cwd=project,
                              env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert first_epoch_run(project, "single", client, timeout=300) is not None
        time.sleep(idle + 1)  # past the idle time, the command still running
        client.send_signal(signal.SIGINT)
        _, first = client.communicate(timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
    again = subprocess.run(["mnist-pipeline", "train", "--mode", "single", "--params", "missing.yaml"], cwd=project,
                           env=env, capture_output=True, text=True, timeout=300)
    served_by = [re.findall(r"a fork of the warm server \(process (\d+)\)", text) for text in (first, again.stderr)]
    assert served_by[0] and served_by[0] == served_by[1], (first[-2000:], again.stderr[-2000:])


def test_an_idle_server_ends_and_only_its_user_reaches_it(served):
    project = served
    idle = f"{scaled(15):g}"  # the probes below must reach the server before it ends, on a busy day too
    env = warm_env(project, MNIST_PIPELINE_WARM_IDLE_S=idle)
    done = subprocess.run(["mnist-pipeline", "train", "--mode", "single", "--params", "missing.yaml"], cwd=project,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "running in this process" not in done.stderr, done.stderr
    (server,) = [pid for pid in servers_for(project) if
                 f"{warm.IDLE_ENV}={idle}".encode() in Path(f"/proc/{pid}/environ").read_bytes()]
    address = listening_address(server)
    assert Path(address).parent == Path(f"/tmp/mnist-pipeline-{os.getuid()}")
    assert Path(address).parent.stat().st_mode & 0o777 == 0o700
    # The name says nothing of the environment (/proc/net/unix shows it to every user): not the key.
    assert warm.server_key(PACKAGES) not in address
    if os.geteuid() == 0:  # another user cannot reach the socket at all
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX) as other:
                    try:
                        other.connect(address)
                        code = 1
                    except PermissionError:
                        code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        # Nor does a process of the same user in another mount namespace (another container).
        probe = ("import socket, sys\n"
                 "s = socket.socket(socket.AF_UNIX)\n"
                 f"s.connect({address!r})\n"
                 "sys.exit(0 if s.recv(100) == b'' else 1)\n")
        other = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", probe],
                               capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr
    deadline = time.monotonic() + float(idle) + 30
    while time.monotonic() < deadline and alive(server):
        time.sleep(0.2)
    assert not alive(server)
    assert not Path(address).exists()  # it removed its socket's file
    with pytest.raises(OSError):
        socket.socket(socket.AF_UNIX).connect(address)


def test_a_private_folder_that_is_not_private_runs_the_command_in_its_own_process(served, request):
    """Another user made the folder first (to catch or stall our commands), or it is open to all:
    no server is started or asked, and the command runs at once in its own process."""
    runtime = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: a socket's path has at most 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(runtime))
    folder = runtime / "mnist-pipeline"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    cases = [("mode drwxrwxrwx", lambda: None)]
    if os.geteuid() == 0:
        cases.append(("owner uid 65534", lambda: (folder.chmod(0o700), os.chown(folder, 65534, 65534))))
    for said, make in cases:
        make()
        env = warm_env(served, XDG_RUNTIME_DIR=str(runtime))
        done = subprocess.run(["mnist-pipeline", "train", "--mode", "single", "--params", "missing.yaml"], cwd=served,
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "missing.yaml: not found" in done.stderr, done.stderr
        (said_why,) = [line for line in done.stderr.splitlines() if "running in this process" in line]
        assert f"{folder} is not this user's private folder (" in said_why and said in said_why, done.stderr
        assert not servers_for(served) and os.listdir(folder) == []
    if os.geteuid() == 0:  # and the right folder, once the wrong one is gone, is made and used
        shutil.rmtree(folder)
        env = warm_env(served, XDG_RUNTIME_DIR=str(runtime))
        done = subprocess.run(["mnist-pipeline", "train", "--mode", "single", "--params", "missing.yaml"], cwd=served,
                              env=env, capture_output=True, text=True, timeout=300)
        assert "a fork of the warm server" in done.stderr, done.stderr
        assert folder.stat().st_uid == os.getuid() and folder.stat().st_mode & 0o777 == 0o700
        assert len(list(folder.glob("warm-*.sock"))) == 1


def test_a_runtime_folder_too_long_for_a_socket_falls_back_to_tmp(monkeypatch, tmp_path):
    """A socket's path has at most 107 bytes: a deep $XDG_RUNTIME_DIR would make bind() fail."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    assert warm.private_folder() == f"/tmp/mnist-pipeline-{os.getuid()}"
    short = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(short))
        assert warm.private_folder() == str(short / "mnist-pipeline")
        assert len(warm.server_address(warm.server_key(PACKAGES)).encode()) <= 107
    finally:
        shutil.rmtree(short)


def test_a_client_sends_nothing_to_another_users_server(monkeypatch):
    """Another user holding a name this user's client connects to gets no command (the private
    folder keeps others from its names; this holds where a folder's checks could be fooled)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to be another user")
    address = f"\0mnist-pipeline-test/{os.getpid()}/{time.monotonic_ns()}"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            squatter = socket.socket(socket.AF_UNIX)
            squatter.bind(address)
            squatter.listen()
            os.write(ready_w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        os.read(ready_r, 1)
        with pytest.raises(warm.Unavailable, match="belongs to uid 65534"):
            warm.Client(address)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_name_that_takes_no_connection_is_passed_over_within_seconds():
    """Another process holds the server's name and accepts nothing: its queue full, connect()
    would wait forever; the client gives up in CONNECT_TIMEOUT_S and the command runs here."""
    address = f"\0mnist-pipeline-test/{os.getpid()}/{time.monotonic_ns()}"
    squatter = socket.socket(socket.AF_UNIX)
    squatter.bind(address)
    squatter.listen(0)
    queued = []
    try:
        while True:  # fill its queue as the squatter would
            sock = socket.socket(socket.AF_UNIX)
            sock.setblocking(False)
            try:
                sock.connect(address)
            except BlockingIOError:
                sock.close()
                break
            queued.append(sock)
        started = time.monotonic()

        def hung(signum, frame):
            raise AssertionError("connect() to a full queue hung")

        previous = signal.signal(signal.SIGALRM, hung)
        signal.alarm(warm.CONNECT_TIMEOUT_S + 10)
        try:
            with pytest.raises(warm.Unavailable, match="takes no connection"):
                warm.Client(address)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        assert time.monotonic() - started < warm.CONNECT_TIMEOUT_S + 8  # the alarm catches a hang
    finally:
        for sock in (*queued, squatter):
            sock.close()


def test_a_client_sends_nothing_to_a_process_of_its_user_in_other_namespaces():
    """A process of the same user in another container that shares the network sees the same
    abstract names: it must not pose as the server (here: another UTS namespace)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a namespace")
    import ctypes

    address = f"\0mnist-pipeline-test/{os.getpid()}/{time.monotonic_ns()}"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if ctypes.CDLL(None, use_errno=True).unshare(0x04000000):  # CLONE_NEWUTS
                os._exit(1)
            impostor = socket.socket(socket.AF_UNIX)
            impostor.bind(address)
            impostor.listen()
            os.write(ready_w, b"x")
            conn, _ = impostor.accept()
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(warm.Unavailable, match="other namespaces"):
            warm.Client(address)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_lock_file_in_the_code_runs_the_stage_and_a_key_that_cannot_be_made_runs_it_here(tmp_path, monkeypatch):
    """An editor's lock file (.#model.py, a link to nowhere) is not code: the stage runs, and its
    runs' code digest is the code's. Any other failure to make the key runs the command in its own
    process rather than failing it."""
    from pipeline import record

    project = make_project(tmp_path / "proj")
    (project / "pipeline" / ".#model.py").symlink_to("root@host.1234:1700000000")
    env = {**project_env(project), "MNIST_PIPELINE_WARM": "1"}
    done = run(["mnist-pipeline", "send-runs", "--mode", "single"], project, check=False, **env)
    assert done.returncode == 0 and "nothing kept" in done.stdout, done.stderr
    assert record.code_digest(record.code_folders_in(project)) == record.code_digest(record.code_folders_in(ROOT))

    def broken(packages) -> str:
        raise PermissionError("a package folder this user cannot read")

    monkeypatch.setattr(warm, "server_key", broken)
    with pytest.raises(warm.Unavailable, match="key could not be computed.*cannot read"):
        warm.connect("train", WARM_APP)


def test_a_client_whose_key_is_not_the_servers_gets_no_fork(served):
    """The name is the key, but a client may connect to any name: one of another environment (a
    stripped one, secrets left out) must not get a fork that carries the server's."""
    env = warm_env(served, MNIST_PIPELINE_WARM_IDLE_S="600", DVC_STAGE="train@bogus")
    subprocess.run(["mnist-pipeline", "train", "--mode-of-dvc-stage"], cwd=served, env=env, capture_output=True,
                   timeout=300)
    [server] = servers_for(served)
    client = warm.Client(listening_address(server))
    client._key = "0" * 40  # what this test process's own environment would name
    with pytest.raises(warm.Refused, match="key is not this server's"):
        client.run(["mnist-pipeline", "train", "--help"])


def test_an_edit_saved_while_the_server_imports_is_not_served(tmp_path):
    """The client's key names the code before the server imported it; an edit saved meanwhile
    (here: by a module the server imports) leaves the server unfit, and the command runs in its
    own process, on the code as it is now."""
    project = make_project(tmp_path / "proj")
    plotting = project / "pipeline" / "plotting.py"
    plotting.write_text(plotting.read_text() + "\n\nwith open(__file__.replace('plotting.py', 'model.py'), 'a') as f:\n"
                        "    f.write('# saved\\n')\n")
    try:
        done = subprocess.run(["mnist-pipeline", "evaluate"], cwd=project, env={**warm_env(project), "MNIST_PIPELINE_DEBUG": "0"},
                              capture_output=True, text=True, timeout=600)
        assert "the warm server cannot serve: the project's code changed while the server imported it" in done.stderr, \
            done.stderr
    finally:
        stop_servers(project)


def test_a_server_unfit_to_fork_says_so_and_the_command_runs_in_its_own_process(served, tmp_path):
    """An import that starts a thread (here a sitecustomize on PYTHONPATH) makes the server unfit:
    the client says why, once, and runs the command itself, with the same result."""
    project = served
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import threading, time\n"
                                           "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    env = {**warm_env(project), "PYTHONPATH": f"{project}{os.pathsep}{site}", "MNIST_PIPELINE_DEBUG": "0"}
    done = subprocess.run(["mnist-pipeline", "train", "--mode", "single", "--params", "missing.yaml"], cwd=project,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "missing.yaml: not found" in done.stderr, done.stderr
    assert "running in this process: the warm server cannot serve: importing started Python threads" in done.stderr


def test_the_key_follows_what_a_fresh_process_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("DVC_STAGE", "train@single")
    key = warm.server_key(PACKAGES)
    monkeypatch.setenv("DVC_STAGE", "train@ddp")  # per command, passed to the fork
    monkeypatch.setenv("DVC_ROOT", "/elsewhere")
    assert warm.server_key(PACKAGES) == key
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read when torch loads: another server
    assert warm.server_key(PACKAGES) != key
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert warm.server_key(PACKAGES) == key
    monkeypatch.chdir(tmp_path)  # a matplotlibrc here would be read
    here = warm.server_key(PACKAGES)
    assert here != key
    (tmp_path / "matplotlibrc").write_text("font.size: 20\n")
    assert warm.server_key(PACKAGES) != here
    monkeypatch.setattr(sys, "warnoptions", ["error"])  # python -W error
    assert warm.server_key(PACKAGES) not in (key, here)
    # The code: a copy of the project, then one edit, each read by a fresh client.
    make_project(tmp_path / "proj")
    keys = []
    for _ in range(2):
        keys.append(subprocess.run([sys.executable, "-c", "from pipeline.runtime.warm import server_key; print(server_key(('pipeline', 'stages')))"],
                                   cwd=tmp_path, env=subprocess_env(PYTHONPATH=str(tmp_path / "proj")),
                                   capture_output=True, text=True, check=True).stdout)
        with (tmp_path / "proj" / "pipeline" / "model.py").open("a") as edit:
            edit.write("\n# edited\n")
    assert keys[0] != keys[1]


def test_the_key_follows_code_from_outside_the_project_and_reinstalls(tmp_path, monkeypatch):
    """A module on PYTHONPATH edited, or one distribution reinstalled at the same version: a fresh
    process would import other code, so a new server."""
    extra = tmp_path / "extra"
    (extra / "helper").mkdir(parents=True)
    module = extra / "helper" / "__init__.py"
    module.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(extra))
    key = warm.server_key(PACKAGES)
    assert warm.server_key(PACKAGES) == key
    module.write_text("VALUE = 22\n")  # another size, as an edit usually makes
    assert warm.server_key(PACKAGES) != key
    (extra / ".venv").mkdir()  # not a package's name: never walked
    (extra / ".venv" / "big.py").write_text("")
    key = warm.server_key(PACKAGES)
    # A reinstall of the same version rewrites the distribution's RECORD.
    record = next(Path(p) for p in sys.path if p.endswith("site-packages")).glob("click-*.dist-info/RECORD")
    record = next(record)
    stamp = record.stat()
    try:
        os.utime(record, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000_000))
        assert warm.server_key(PACKAGES) != key
    finally:
        os.utime(record, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert warm.server_key(PACKAGES) == key


def test_python_u_is_a_fact_of_the_key_and_reaches_the_fork():
    """sys.flags does not say -u; the streams do. A client under -u gets a server started with -u,
    whose forks write through, as `python -u` promises."""
    probe = ("from pipeline.runtime import warm; from stages.entry import PACKAGES; import sys; "
             "print(warm.unbuffered(), sys.stdout.write_through, warm.server_key(PACKAGES))")
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONUNBUFFERED"}
    plain, unbuffered = (subprocess.run([sys.executable, *flags, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                                        text=True, check=True).stdout.split() for flags in ([], ["-u"]))
    assert plain[:2] == ["False", "False"] and unbuffered[:2] == ["True", "True"]
    assert plain[2] != unbuffered[2]


def test_not_for_an_outer_launchers_workers_nor_for_help(monkeypatch):
    monkeypatch.setenv("DVC_STAGE", "train@ddp")
    monkeypatch.delenv(warm.WARM_ENV, raising=False)
    assert warm.wanted(["train", "--mode-of-dvc-stage"])
    assert not warm.wanted(["--help"]) and not warm.wanted(["train", "--help"]) and not warm.wanted([])
    monkeypatch.setenv("RANK", "0")
    assert not warm.wanted(["train", "--mode-of-dvc-stage"])
    monkeypatch.delenv("RANK")
    monkeypatch.setenv(warm.WARM_ENV, "0")
    assert not warm.wanted(["train", "--mode-of-dvc-stage"])
    monkeypatch.delenv("DVC_STAGE")
    monkeypatch.setenv(warm.WARM_ENV, "1")
    assert warm.wanted(["evaluate"])


# The server's own preload, in a fresh interpreter as the server is, every CUDA call refused.
NO_CUDA_IN_THE_SERVER = REFUSE_CUDA + """
from pipeline.runtime.warm_server import preload
from stages.entry import WARM_APP
print("problem:", preload(WARM_APP["preload"]))
print("calls:", calls)
"""


@pytest.fixture(scope="module")
def stand_in_driver(tmp_path_factory) -> Path:
    """A folder holding the stand-in libcuda.so.1 and libnvidia-ml.so.1, for LD_LIBRARY_PATH."""
    return build_stand_in_driver(tmp_path_factory.mktemp("driver"))


DRIVER_LOADED_NOT_INITIALISED = """
import ctypes
from pipeline.runtime.warm_server import preload
from stages.entry import WARM_APP
print("problem:", preload(WARM_APP["preload"]))
maps = open("/proc/self/maps").read()
print("mapped:", any(line.endswith("/libcuda.so.1") and "driver" in line for line in maps.splitlines()))
nvml = ctypes.CDLL("libnvidia-ml.so.1")  # loaded, as pynvml loads it
print("nvml loaded:", preload(WARM_APP["preload"]))
nvml.nvmlInit_v2()  # what torch.cuda.device_count() may reach, and MLflow's GPU monitor
print("after nvmlInit:", preload(WARM_APP["preload"]))
nvml.nvmlShutdown()
ctypes.CDLL("libcuda.so.1").cuInit(0)  # what torch.cuda.is_available() reaches
print("after cuInit:", preload(WARM_APP["preload"]))
"""


def test_a_driver_that_import_torch_loads_but_nothing_initialised_leaves_the_server_fit(stand_in_driver, tmp_path):
    """On a GPU host `import torch` maps libcuda.so.1 and calls nothing in it: the server is fit to
    fork (it used to refuse, so no stage there was ever served); once cuInit ran, it is not."""
    log = tmp_path / "calls"
    done = subprocess.run([sys.executable, "-c", DRIVER_LOADED_NOT_INITIALISED], cwd=ROOT, capture_output=True,
                          text=True, env=subprocess_env(LD_LIBRARY_PATH=str(stand_in_driver), STAND_IN_CUDA_LOG=str(log)))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-5:-2] == ["problem: None", "mapped: True", "nvml loaded: None"], done.stdout
    assert lines[-2].startswith("after nvmlInit: the NVIDIA driver was initialised while importing (libnvidia-ml.so.1)")
    assert lines[-1].startswith("after cuInit: the NVIDIA driver was initialised while importing (libcuda.so.1)")
    calls = [line.split()[1] for line in log.read_text().splitlines()]
    before = calls[:calls.index("nvmlInit_v2")]  # only the questions that initialise nothing
    assert set(before) <= {"cuDeviceGetCount", "nvmlDeviceGetCount_v2"} and "cuDeviceGetCount" in before


def test_a_stage_on_a_host_with_a_driver_is_served(stand_in_driver, served):
    """The issue's host: every stage printed "the warm server cannot serve" and ran on its own."""
    env = {**warm_env(served, LD_LIBRARY_PATH=str(stand_in_driver)), "DVC_STAGE": "train@bogus"}
    done = subprocess.run(["mnist-pipeline", "train", "--mode-of-dvc-stage"], cwd=served, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "--mode-of-dvc-stage needs a stage train@<mode>" in done.stderr, done.stderr
    assert "running in this process" not in done.stderr and len(servers_for(served)) == 1


def test_what_the_server_imports_never_touches_cuda_nor_starts_a_thread():
    """A fork of a process that initialised the CUDA driver cannot use the GPUs: nothing the
    server imports may call into torch's CUDA runtime, and preload() must find it fit to fork."""
    done = subprocess.run([sys.executable, "-c", NO_CUDA_IN_THE_SERVER], cwd=ROOT, capture_output=True, text=True,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["problem: None", "calls: []"], done.stdout
