"""Shared fixtures: where the real MNIST lives, tiny IDX files, and a throwaway project copy."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests import zygote

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = ROOT.parent / "shared" / "data" / "mnist"
VENV_BIN = Path(sys.executable).parent
# What a project copy needs to run its stages: the code, the DVC/params files and the lock runs record.
PROJECT_FILES = ("pipeline", "stages", "workloads", "deploy", "dvc.yaml", "params.yaml", "requirements.lock", ".dvcignore", ".gitignore",
                 ".dvc/config", ".dvc/plots")


# MNIST_SOURCE as a user sets it for `make test`, relative to the checkout, made absolute: the tests
# run stages in projects of their own, elsewhere, which inherit it (and every process they start).
if os.environ.get("MNIST_SOURCE"):
    os.environ["MNIST_SOURCE"] = str(Path(os.environ["MNIST_SOURCE"]).resolve())


def find_mnist(environ: dict[str, str]) -> Path:
    """Real MNIST for the tests: MNIST_SOURCE when set (as on a GPU host, where `make gpu-check`
    runs them), else the shared folder beside the repo; the four IDX files raw or gzipped, as
    prepare reads them."""
    from pipeline.errors import DataError
    from pipeline.mnist import find_idx_file

    folder = Path(environ.get("MNIST_SOURCE") or MNIST_DIR)
    try:
        for prefix in ("train", "t10k"):
            for kind in ("images-idx3", "labels-idx1"):
                find_idx_file(folder, f"{prefix}-{kind}-ubyte")
    except DataError as exc:
        pytest.fail(f"real MNIST not found ({exc}); set MNIST_SOURCE to the folder that holds it")
    return folder


# How much slower the machine is today than on the fast day the tests' own deadlines were set on:
# a bare `import torch` (benchmarks/suite_time.py's unit) over FAST_UNIT_S, the fastest unit seen
# (docs/testing.md), from 1 to SLOWNESS_CAP. Measured once per `pytest` run, before its workers
# start, which inherit it (and so does a pytest started inside, as the fast tier's). #52: on a
# day when the unit took 4 s, a fixed deadline tuned on a 1.6 s day failed CI.
SLOWNESS_ENV = "MNP_TEST_SLOWNESS"
FAST_UNIT_S = 1.6
SLOWNESS_CAP = 5.0


def machine_slowness() -> float:
    if SLOWNESS_ENV not in os.environ:
        took = []
        for _ in range(2):  # the quicker of two: a first import may read a cold disk
            started = time.monotonic()
            subprocess.run([sys.executable, "-c", "import torch"], check=True)
            took.append(time.monotonic() - started)
        os.environ[SLOWNESS_ENV] = f"{min(SLOWNESS_CAP, max(1.0, min(took) / FAST_UNIT_S)):.2f}"
    return float(os.environ[SLOWNESS_ENV])


def scaled(seconds: float) -> float:
    """A deadline of `seconds` on a fast day, stretched by how much slower today is: for waits on a
    process's start, imports and first steps, whose length follows the machine's."""
    return seconds * machine_slowness()


def pytest_configure(config) -> None:
    if not (config.option.help or config.option.collectonly):
        machine_slowness()
    # A suite started in the background of a shell (`make test &`) inherits SIGINT ignored, and so
    # would every process it starts, as the Ctrl-C tests' commands would: restore Python's default,
    # which a child's exec turns back into the default action.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# The files that take longest, first: `make test` hands a file at a time to each worker
# (pytest-xdist's --dist loadfile, --no-loadscope-reorder), so a long file started last would end
# the run alone (at 0cccd97 test_workloads.py, collected last, ran 165 s after the other worker
# had ended). Ordered by each file's wall seconds in the workers' run (MNP_TEST_TIMELINE,
# benchmarks/timeline.py), then the fast tier's longest (`make test-fast` keeps this order too); the
# rest, under 60 s each, keep their order.
LONGEST_FIRST = ("test_multinode", "test_reproduce", "test_readme", "test_warm", "test_train_modes", "test_full_mnist",
                 "test_dvc_pipeline", "test_start_checks", "test_tracking", "test_workloads", "test_faults",
                 "test_commcheck", "test_dvc_experiments_tracking", "test_image_workload", "test_tracking_outage",
                 "test_repro_restart", "test_failure_modes", "test_step_checkpoints", "test_killed_rank",
                 "test_breakdown", "test_preemption", "test_uneven_shares", "test_forkserver", "test_launchers",
                 "test_scaling_curve", "test_devices", "test_security", "test_tracking_helper", "test_spread",
                 "test_fast_tier")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
    # Every test's timeout by today's slowness, at least 1.5 times (the slowness is measured once, at
    # the start, and a shared machine can slow down later) and at most doubled (a hung test must
    # still end within CI's limit, with pytest-timeout's stacks): its own marker's, else pytest-timeout's setting
    # (--timeout, then PYTEST_TIMEOUT, then the ini's), as that plugin looks it up.
    if config.option.collectonly or not config.pluginmanager.hasplugin("timeout"):
        return
    default = next((value for value in (config.getoption("timeout", None), os.environ.get("PYTEST_TIMEOUT"),
                                        config.getini("timeout")) if value not in (None, "")), 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        kwargs = dict(marker.kwargs) if marker else {}
        timeout = float((marker.args[0] if marker and marker.args else kwargs.pop("timeout", default)) or 0)
        kwargs.pop("timeout", None)
        if timeout > 0:
            item.add_marker(pytest.mark.timeout(min(max(scaled(timeout), 1.5 * timeout), 2 * timeout),
                                                *(marker.args[1:] if marker else ()),
                                                **kwargs), append=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `alone` (its claim is a timing) runs while no other worker runs a test: each
    test holds a shared lock on one file from its setup (the module's fixtures included) to its
    teardown, an `alone` test an exclusive one, which it gets between two of the other's tests.
    (`make test` runs them after the others, in one process; this holds them in `make test-fast`
    and a `pytest -n` run, where a worker waits out the other's test.)"""
    factory = getattr(item.config, "_tmp_path_factory", None)
    workerinput = getattr(item.config, "workerinput", {})
    worker = workerinput.get("workerid")
    with contextlib.ExitStack() as stack:
        asked = time.time()
        if factory is not None and worker is not None:
            import fcntl

            lock = factory.getbasetemp().parent / "alone.lock"  # the run's folder, one for all its workers
            handle = stack.enter_context(lock.open("a"))
            fcntl.flock(handle, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        got, cpu = time.time(), cpu_seconds()
        try:
            return (yield)
        finally:
            if timeline := os.environ.get("MNP_TEST_TIMELINE"):  # where a run's time goes: docs/testing.md
                with open(timeline, "a") as out:
                    run = workerinput.get("testrunuid", f"pid{os.getpid()}")[:12]  # one pytest run: its workers
                    out.write(f"{run} {worker or 'main'} {asked:.2f} {got:.2f} {time.time():.2f} "
                              f"{cpu_seconds() - cpu:.1f} {item.nodeid}\n")


def cpu_seconds() -> float:
    """This process's CPU seconds and those of the processes it started that have ended and were
    waited for (theirs too, where they waited): what a test cost, servers it killed included."""
    import resource

    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(usage.ru_utime + usage.ru_stime for usage in usages) + zygote.CPU_USED[0]  # commands run as forks


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    return find_mnist(dict(os.environ))


def idx_bytes(array: list | bytes, dims: tuple[int, ...]) -> bytes:
    """An IDX file of unsigned bytes with the given dimensions."""
    return struct.pack(">HBB", 0, 0x08, len(dims)) + struct.pack(f">{len(dims)}I", *dims) + bytes(array)


def write_tiny_mnist(folder: Path, n_train: int = 40, n_test: int = 20) -> Path:
    """Four small, well-formed IDX files (not canonical MNIST: verify_checksums must be off)."""
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        pixels = [i % 256 for i in range(n * 28 * 28)]
        (folder / f"{prefix}-images-idx3-ubyte").write_bytes(idx_bytes(pixels, (n, 28, 28)))
        (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_bytes([i % 10 for i in range(n)], (n,)))
    return folder


def process_cpu_seconds(pid: int) -> float:
    """The CPU time of process `pid` so far, every thread's, ended ones too: the kernel's process clock.

    Linux names another process's clock ((~pid) << 3) | CPUCLOCK_SCHED (2); reading it raises OSError
    once the process is reaped.
    """
    return time.clock_gettime_ns(((~pid) << 3) | 2) / 1e9


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # mlflow.set_tracking_uri() in a test exports this; a stage must only see what a test passes.
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["DVC_NO_ANALYTICS"] = "1"
    # S3 credentials come from what a test passes (tests/s3.py), never from this machine's account,
    # its profile files or an instance's metadata service.
    for key in [key for key in env if key.startswith("AWS_")]:
        del env[key]
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """`cmd` as subprocess.run runs it, its output captured; a `mnist-pipeline` command as a fork of
    this worker's pre-imported starter where it can be one (tests/zygote.py), else afresh."""
    full_env = subprocess_env(**env)
    starter, how = None, "afresh"
    if cmd[0] == "mnist-pipeline" and shutil.which(cmd[0], path=full_env["PATH"]) == str(VENV_BIN / cmd[0]):
        starter, how = zygote.starter_for(str(VENV_BIN / "python"), full_env, cwd)
    if starter is not None:
        proc = starter.run(str(VENV_BIN / cmd[0]), cmd[1:], cwd, full_env)
    else:
        proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True)
    zygote.log(cmd, how)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def make_project(dest: Path, params: dict | None = None) -> Path:
    """A git repo holding a copy of the project, with `params` merged into params.yaml."""
    for name in PROJECT_FILES:
        src = ROOT / name
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, target)
    merged = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, values in (params or {}).items():
        merged.setdefault(section, {}).update(values)
    (dest / "params.yaml").write_text(yaml.safe_dump(merged, sort_keys=False))
    run(["git", "init", "-q", "-b", "main"], dest)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A"], dest)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"], dest)
    return dest


def table_csv(path: Path, rows: int = 600) -> Path:
    """A table a team might have: y a smooth function of three columns, plus a little noise."""
    import torch

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 3, generator=generator, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] + 0.05 * torch.randn(rows, generator=generator, dtype=torch.float64)
    lines = ["id,x1,x2,x3,y"] + [f"{i},{a:.6f},{b:.6f},{c:.6f},{t:.6f}" for i, ((a, b, c), t) in
                                 enumerate(zip(x.tolist(), y.tolist()))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


# examples/workloads/table.py as params.yaml names it once copied into a project (add_table_workload).
TABLE = {"class_path": "workloads.table.Regression",
         "init_args": {"source": "data/table.csv", "features": ["x1", "x2", "x3"], "target": "y", "hidden": 16}}


def add_table_workload(project: Path) -> Path:
    """examples/workloads/table.py in `project` as docs/workloads.md tells a team: the module in
    workloads/, its table in data/, and both in the prepare stage's deps and params; the table's path."""
    (project / "workloads/table.py").write_text((ROOT / "examples/workloads/table.py").read_text())
    table = table_csv(project / "data/table.csv")
    stages = yaml.safe_load((project / "dvc.yaml").read_text())
    stages["stages"]["prepare"]["deps"].append("data/table.csv")
    stages["stages"]["prepare"]["params"] = ["data", "workload.class_path", "workload.init_args"]
    (project / "dvc.yaml").write_text(yaml.safe_dump(stages, sort_keys=False))
    return table


def commit(project: Path, message: str) -> None:
    run(["git", "add", "-A"], project)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], project)


def code_at(project: Path, commit: str) -> str:
    """The code digest a run records, of the project's code at `commit`."""
    from pipeline import record

    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", commit, "pipeline", "stages", "workloads"], cwd=project, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        return record.code_digest(record.code_folders_in(Path(tmp)))


def commit_notes(project: Path) -> None:
    """Two tracked files a patch must carry byte for byte: one in latin-1, one with CRLF line ends."""
    (project / "notes").mkdir()
    (project / "notes" / "latin1.txt").write_bytes("Grüße aus Köln\n".encode("latin-1"))
    (project / "notes" / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    run(["git", "add", "notes"], project)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "notes"], project)


def edit_notes(project: Path) -> None:
    with (project / "notes" / "latin1.txt").open("ab") as handle:
        handle.write("Grüße auch aus Zürich\n".encode("latin-1"))
    with (project / "notes" / "crlf.txt").open("ab") as handle:
        handle.write(b"three\r\n")


def write_params(path: Path, **sections: dict) -> Path:
    """The project's params.yaml (every knob, as a params file must hold) with `sections` merged in."""
    merged = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, values in sections.items():
        merged[section].update(values)
    path.write_text(yaml.safe_dump(merged, sort_keys=False))
    return path


def project_env(project: Path, **extra: str) -> dict[str, str]:
    """Run the copy's own code, not the editable install's."""
    return {"PYTHONPATH": str(project), **extra}


SMALL = {"data": {"train_limit": 1100, "val_size": 100},
         "commcheck": {"max_bytes": 65536, "iters": 3},
         "train": {"epochs": 2, "batch_size": 100, "nproc": 2, "mem_per_rank_gb": 0.5},  # Slurm's test nodes: 2000 MB
         "evaluate": {"min_test_accuracy": 0.5}}  # about 80% after 20 steps on 1000 images


_PREPARED: dict[tuple[str, str], Path] = {}  # (data settings, source) -> what prepare wrote for them


def prepare(project: Path, source: Path) -> None:
    """`mnist-pipeline prepare` in `project`, from the MNIST files in `source`. A test process runs
    the command once for each data settings and source, and later projects of the same two get a
    copy of what it wrote (the same bytes a run would write: prepare is seeded, and records only
    the settings and the files' digests), which saves each a process's imports and reading. A test
    whose claim is prepare itself runs the command."""
    data = yaml.safe_load((project / "params.yaml").read_text())["data"]
    key = (json.dumps(data, sort_keys=True), str(source))
    if key not in _PREPARED:
        run(["mnist-pipeline", "prepare"], project, **project_env(project, MNIST_SOURCE=str(source)))
        _PREPARED[key] = Path(tempfile.mkdtemp(prefix="mnp-prepared-"))  # out of every test's tmp_path
        atexit.register(shutil.rmtree, _PREPARED[key], ignore_errors=True)
        shutil.copytree(project / "data/prepared", _PREPARED[key], dirs_exist_ok=True)
    else:
        shutil.copytree(_PREPARED[key], project / "data/prepared")


@pytest.fixture(scope="module")
def small_project(tmp_path_factory, mnist_dir) -> Path:
    """A project copy with a prepared 1000-image slice of real MNIST: 10 steps per epoch."""
    project = make_project(tmp_path_factory.mktemp("small") / "proj", SMALL)
    prepare(project, mnist_dir)
    return project


def train_cli(project: Path, mode: str, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    return run(["mnist-pipeline", "train", "--mode", mode, *args], project, check=check, **project_env(project, **env))


def load_weights(project: Path, mode: str) -> dict:
    import torch

    return torch.load(project / "models" / mode / "model.pt", weights_only=True)["state_dict"]


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def relative_difference(a: dict, b: dict) -> float:
    """|a - b| / |a| over all weights together (L2): how far two trainings' weights are apart."""
    assert a.keys() == b.keys()
    diff = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a) ** 0.5
    return diff / sum(float(a[k].double().norm() ** 2) for k in a) ** 0.5


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# How the project starts an MLflow server (make ui, docs/mlflow.md, docs/multi-node.md): without
# MLflow's GenAI job runner and its huey consumers, idle Python processes this pipeline never uses.
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start_mlflow_server(home: Path, *args: str, artifacts: str | None = None, env: dict[str, str] | None = None):
    """A real `mlflow server` on 127.0.0.1 with its own SQLite store and artifact folder in `home`
    (or `artifacts`, a URL; "": none, for a server that serves no artifacts), `args` on its command
    line and `env` in its environment: its process, its URI and its log, once it answers (if only
    to refuse)."""
    import urllib.error
    import urllib.request

    port = free_port()
    log = open(home / "server.log", "w")  # noqa: SIM115 (lives with the server)
    proc = subprocess.Popen(
        ["mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{home / 'server.db'}",
         *(["--artifacts-destination", artifacts or str(home / "artifacts")] if artifacts != "" else []), *args],
        cwd=home, env=subprocess_env(**SERVER_ENV, **(env or {})), stdout=log, stderr=subprocess.STDOUT,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except urllib.error.HTTPError:  # an answer all the same
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"mlflow server did not start:\n{(home / 'server.log').read_text()}")
            time.sleep(0.5)
    return proc, uri, log


def stop_mlflow_server(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1, with its own SQLite store and artifact folder."""
    proc, uri, log = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    yield uri
    stop_mlflow_server(proc, log)


def ddp_worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's training workers: the processes under it (torchrun's agent
    forks them from the fork server, pipeline.runtime.forkserver) that hold a rank's log open. A
    worker's own fork holds it too while it lives (a subprocess between its fork and its exec):
    of a rank's holders, the worker is the one whose parent holds no rank's log."""
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            status = (proc / "status").read_text() if proc.name.isdigit() else ""
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("PPid:"):
                parents[int(proc.name)] = int(line.split()[1])
    under, found = {launcher}, {}
    for _ in range(3):  # the launcher, the fork server, the workers
        under |= {pid for pid, parent in parents.items() if parent in under}
    for pid in under - {launcher}:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:  # one fd closed since the listing is no reason to pass over the process
                target = os.readlink(fd)
            except OSError:
                continue
            if (log := re.search(r"/logs/rank-(\d+)\.log$", target)):
                found[pid] = int(log[1])
    return {rank: pid for pid, rank in found.items() if parents.get(pid) not in found}


def first_epoch_run(project: Path, mode: str, proc: subprocess.Popen, timeout: float = 180):
    """The parent run of `proc`'s training of `mode` once it has logged its first epoch; None if
    `proc` ends or `timeout` (on a fast day: `scaled`) passes first. The store is opened only once
    models/<mode>/mlflow_run.json exists, which the training writes when its runs exist: a client
    opening a new SQLite store makes its schema, and two processes making one at once break it
    (MLflow does not lock), as a user's `mlflow ui` started on a fresh store at the same moment would."""
    from mlflow import MlflowClient

    ids_file, client = project / "models" / mode / "mlflow_run.json", None
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline and proc.poll() is None:
        if ids_file.is_file():
            client = client or MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
            parent = client.get_run(json.loads(ids_file.read_text())["parent"])
            if "val_loss" in parent.data.metrics:
                return parent
        time.sleep(0.5)
    return None


# The start of a script for a fresh interpreter that then imports what a server forks from (the
# DDP fork server, the warm server): every CUDA call torch could make on its way to initialising
# the driver (cuInit), which a fork would inherit broken, is made to fail loudly and is noted in
# `calls`, which the script prints last.
def build_stand_in_driver(folder: Path) -> Path:
    """`folder` with a stand-in NVIDIA driver (tests/stand_in_libcuda.c: one device, every call
    logged with its pid to $STAND_IN_CUDA_LOG) as libcuda.so.1 and libnvidia-ml.so.1, for
    LD_LIBRARY_PATH; skips the test where there is no gcc."""
    import shutil

    import pytest

    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the stand-in driver")
    for library in ("libcuda.so.1", "libnvidia-ml.so.1"):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / library), str(ROOT / "tests" / "stand_in_libcuda.c")],
                       check=True)
    return folder


REFUSE_CUDA = """
import torch

calls = []
def refused(name):
    def call(*args, **kwargs):
        calls.append(name)
        raise RuntimeError(name + " called while preloading")
    return call
for name in ("_cuda_getDeviceCount", "_cuda_init", "_cuda_getDevice", "_cuda_setDevice"):
    setattr(torch._C, name, refused(name))
torch.cuda._lazy_init = refused("torch.cuda._lazy_init")
"""
