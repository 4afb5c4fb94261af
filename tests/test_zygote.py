"""The tests' starter (tests/zygote.py): a command run as a fork of it sees what a fresh process of
the same script sees, ends the same way, and is killed with its group when its test goes away;
a command the fork could not stand in for runs afresh. And the harness's ranks
(tests/ddp_harness.run_ranks): forks of a fork server that take the test's environment."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from tests import zygote
from tests.conftest import VENV_BIN, make_project, run, subprocess_env

# What a script can tell of the process it runs in, as JSON on stdout.
REPORT = textwrap.dedent("""\
    import json, os, random, signal, stat, sys
    main = sys.modules["__main__"]
    seen = {
        "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path, "umask": os.umask(0o22),
        "env": {k: v for k, v in os.environ.items() if k != "_"},
        "main": [main.__name__, getattr(main, "__file__", None)],
        "streams": [stat.S_IFMT(os.fstat(fd).st_mode) != stat.S_IFREG for fd in (1, 2)] + [sys.stdout.isatty()],
        "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGPIPE, signal.SIGTERM, signal.SIGHUP,
                                                       signal.SIGCHLD)],
        "project_imported": sorted(n for n in sys.modules if n.split(".")[0] in ("pipeline", "stages")),
        "draw": random.random(),
        "name": open("/proc/self/comm").read().strip(),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }
    import pipeline
    seen["pipeline"] = pipeline.__file__
    how = os.environ.get("MNP_TEST_END", "")
    if not how:  # MLflow's loggers, as the pipeline's settings and MLflow's import leave them
        import pipeline.tracking, mlflow, logging
        seen["loggers"] = {name: logging.getLogger(name).level for name in ("mlflow", "alembic", "botocore")}
    print(json.dumps(seen))
    print("to stderr", file=sys.stderr)
    if how == "exit":
        sys.exit(3)
    if how == "raise":
        raise ValueError("a line of its own")
    if how == "signal":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "wait":
        open(os.environ["MNP_TEST_PIDFILE"], "w").write(str(os.getpid()))
        import time
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("zygote") / "report"
    path.write_text(f"#!{VENV_BIN / 'python'}\n{REPORT}")
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def starter():
    started = zygote.Starter(str(VENV_BIN / "python"), subprocess_env())
    yield started
    started.close()


def fresh(script, cwd, env):
    return subprocess.run([script], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.fast
def test_a_fork_sees_what_a_fresh_process_of_the_script_sees(tmp_path, script, starter):
    project = make_project(tmp_path / "proj")
    # PYTHONPATH as a test might write it: Python makes its entries absolute and drops repeats.
    env = subprocess_env(MNIST_SOURCE="/nowhere", MLFLOW_TRACKING_URI="sqlite:///x.db",
                         PYTHONPATH=f"{project}::relative:{project}")
    assert starter.serves(env, project)
    # What the test ignores and blocks as it runs a command, the command does too (nohup's SIGHUP).
    old = os.umask(0o027), signal.signal(signal.SIGHUP, signal.SIG_IGN), \
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        forked, afresh = starter.run(script, [], project, env), fresh(script, project, env)
    finally:
        os.umask(old[0])
        signal.signal(signal.SIGHUP, old[1])
        signal.pthread_sigmask(signal.SIG_SETMASK, old[2])
    assert forked.returncode == afresh.returncode == 0
    assert forked.stderr == afresh.stderr == "to stderr\n"
    a, b = json.loads(forked.stdout), json.loads(afresh.stdout)
    assert a.pop("draw") != b.pop("draw")  # seeded afresh in the fork too
    assert a == b
    assert b["pipeline"] == str(project / "pipeline" / "__init__.py")  # the copy's code, imported in the fork
    assert b["project_imported"] == [] and b["umask"] == 0o027 and b["blocked"] == [signal.SIGUSR1]
    assert b["signals"][3] in ("1", str(signal.SIG_IGN))  # SIGHUP: ignored
    assert b["loggers"]["mlflow"] == logging.WARNING  # pipeline.tracking's setting, before MLflow's import
    # Two forks draw differently too.
    assert json.loads(starter.run(script, [], project, env).stdout)["draw"] != json.loads(forked.stdout)["draw"]


@pytest.mark.parametrize("how, code, said", [("exit", 3, ""), ("raise", 1, "ValueError: a line of its own\n"),
                                             ("signal", -signal.SIGTERM, "")])
def test_a_fork_ends_as_a_fresh_process_does(tmp_path, script, starter, how, code, said):
    env = subprocess_env(MNP_TEST_END=how)
    forked, afresh = starter.run(script, [], tmp_path, env), fresh(script, tmp_path, env)
    assert forked.returncode == afresh.returncode == code
    assert forked.stderr == afresh.stderr and afresh.stderr.startswith("to stderr\n") and afresh.stderr.endswith(said)
    assert forked.stdout.startswith("{") and afresh.stdout.startswith("{")


def test_a_command_whose_test_went_away_is_killed_with_its_group(tmp_path, script, starter):
    pidfile = tmp_path / "pid"
    env = subprocess_env(MNP_TEST_END="wait", MNP_TEST_PIDFILE=str(pidfile))
    with open(tmp_path / "out", "w+b") as out:
        conn = starter.start([script], tmp_path, env, out.fileno(), out.fileno())
        deadline = time.monotonic() + 60
        while not pidfile.is_file() or not pidfile.read_text():
            assert time.monotonic() < deadline, out.read()
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        conn.close()  # what the kernel does when a test worker dies
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the command outlived its test"
        time.sleep(0.05)


def test_what_a_fork_cannot_stand_in_for_runs_afresh(tmp_path, starter):
    base = subprocess_env()
    project = make_project(tmp_path / "proj")
    assert starter.serves({**base, "MNIST_SOURCE": "x", "PYTHONPATH": str(project), "MLFLOW_TRACKING_URI": "x"}, tmp_path)
    # pipeline.tracking's own setting, set or not, is what MLflow was imported with.
    assert starter.serves({**base, "MLFLOW_LOGGING_LEVEL": "WARNING"}, tmp_path)
    for changed in ({"TMPDIR": str(tmp_path)}, {"OMP_NUM_THREADS": "1"}, {"RANK": "0"}, {"CXX": "no"},
                    {"MLFLOW_LOGGING_LEVEL": "DEBUG"}, {"MNIST_PIPELINE_WARM": "1"}, {"DVC_STAGE": "train"}):
        assert not starter.serves({**base, **changed}, tmp_path), changed
    assert not starter.serves({k: v for k, v in base.items() if k != "PATH"}, tmp_path)
    assert not starter.serves(base, tmp_path / "no-such-folder")  # subprocess.run's own error
    # A module on PYTHONPATH that the starter imported (or Python imports at start) would be that one.
    (tmp_path / "shadow").mkdir()
    for module in ("yaml.py", "sitecustomize.py"):
        (tmp_path / "shadow" / module).write_text("")
        assert not starter.serves({**base, "PYTHONPATH": f"{project}:shadow"}, tmp_path), module
        (tmp_path / "shadow" / module).unlink()


def test_the_tests_commands_run_as_forks_where_they_can(tmp_path):
    """conftest.run: a `mnist-pipeline` command runs as a fork; one with a setting the imports
    read runs afresh the first time, and in a starter of its own from the second."""
    if sys.platform != "linux" or os.environ.get(zygote.ZYGOTE_ENV) == "0":
        pytest.skip("commands run afresh here")
    log, own = tmp_path / "log", {"ZYGOTE_TEST_TOKEN": uuid.uuid4().hex}  # an environment no other test has
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MNP_TEST_ZYGOTE_LOG", str(log))
        for env in ({}, own, own):
            said = run(["mnist-pipeline", "--version"], tmp_path, **env)
            assert said.returncode == 0 and said.stdout.startswith("mnist-pipeline, version")
    zygote.forget(subprocess_env(**own))
    assert [line.split("\t")[2] for line in log.read_text().splitlines()][1:] == [
        "afresh: the first command with its environment", "fork"]


def report_rank(r: int, world: int, out) -> None:
    (out / f"rank-{r}.json").write_text(json.dumps({"parent": os.getppid(), "token": os.environ.get("MNP_TEST_TOKEN"),
                                                    "omp": os.environ.get("OMP_NUM_THREADS")}))


def test_the_harness_ranks_are_forks_that_take_the_tests_environment(tmp_path, monkeypatch):
    """tests/ddp_harness.run_ranks: ranks forked by a server that imported torch once, each with
    the test's environment as it is when they start; spawned afresh where the test changed what
    those imports read."""
    from tests.ddp_harness import run_ranks, start_method

    if start_method() != "forkserver":
        pytest.skip("ranks are spawned here (MNP_TEST_ZYGOTE=0, or this worker's environment changed)")
    for token in ("first", "set after the server started"):  # the server runs by the second, at the latest
        monkeypatch.setenv("MNP_TEST_TOKEN", token)  # read late: the ranks fork
        run_ranks(2, report_rank, tmp_path)
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert {rank["token"] for rank in seen} == {"set after the server started"}
    assert seen[0]["parent"] == seen[1]["parent"] != os.getpid()  # the fork server's children
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read by torch on import: afresh
    assert start_method() == "spawn"
    run_ranks(2, report_rank, tmp_path)
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [rank["omp"] for rank in seen] == ["3", "3"] and seen[0]["parent"] == os.getpid()
