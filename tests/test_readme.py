"""The README's quick start and workflows, run as written: in a fresh shell (no venv active) on a
clean clone of this repository, one block at a time as a newcomer pastes it."""

import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import yaml

from tests.conftest import ROOT, SMALL
from tests.hosts import wait_until

FRESH_PATH = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not p.startswith(str(ROOT)))


def blocks(section: str) -> list[str]:
    """The ```bash blocks of one README section, each line without its comment."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"```bash\n(.*?)```", body, re.S)
    assert found, f"README.md: no bash block under ## {section}"
    return [line.split("  #", 1)[0].rstrip() for block in found for line in block.splitlines() if line.strip()]


def clean_clone(dest: Path) -> Path:
    """A clone of the committed project, its tests' small slice committed as params.yaml, reusing
    this checkout's venv (installed from the same lock: make sees it up to date)."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    for name in ("requirements-dev.lock", "pyproject.toml"):
        os.utime(dest / name, (0, 0))  # older than the venv's stamps, as after `make install`
    params = yaml.safe_load((dest / "params.yaml").read_text())
    for section, values in SMALL.items():
        params[section].update(values)
    params["evaluate"]["min_test_accuracy"] = 0.1  # the classic model (dropout) on 20 steps is no gate's business
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "-qam", "a small slice for the test"], cwd=dest, check=True)
    return dest


def fresh_env(cwd: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PATH=FRESH_PATH, PYTHONPATH=str(cwd))  # PYTHONPATH: the clone's code, not this checkout's
    return env


def shell(script: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=fresh_env(cwd), capture_output=True, text=True,
                          timeout=timeout)


def serve_until_it_answers(script: str, cwd: Path, port: int, timeout: float = 90) -> tuple[str, list[str]]:
    """Runs a command that serves on 127.0.0.1:`port` until stopped; stops it (SIGTERM, as Ctrl-C
    would) once it answers, and returns its output and the command lines of the processes it ran
    then. Fails if it ends by itself or never answers."""
    with socket.socket() as probe:  # another server there would answer for it
        assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is taken before `{script}`: free it"
    url = f"http://127.0.0.1:{port}/health"
    server = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=fresh_env(cwd), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def answers() -> bool:
        assert server.poll() is None, f"{script}: ended by itself ({server.returncode}):\n{server.stdout.read()}"
        try:
            urllib.request.urlopen(url, timeout=2)
            return True
        except OSError:
            return False

    try:
        wait_until(answers, f"{script}: {url} answering", timeout=timeout, interval=0.3)
        running = session_commands(server.pid)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            output = server.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
    return output, running


def session_commands(sid: int) -> list[str]:
    """The command line of every process in session `sid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == sid:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # ended meanwhile
            continue
    return found


def test_quick_start_and_workflows_work_as_written(tmp_path, mnist_dir):
    project = clean_clone(tmp_path / "clone")
    quick = [line.replace("/path/to/mnist", str(mnist_dir)) for line in blocks("Quick start")]
    assert quick[0].startswith(f"MNIST_SOURCE={mnist_dir} make run") and "source .venv/bin/activate" in quick

    ui = [line for line in quick if line.startswith("make ui")]
    first = shell("set -e\n" + "\n".join(line for line in quick if line not in ui), project)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "Running stage 'compare'" in first.stdout
    assert re.search(r"^workspace .* single +\d+\.\d+% ", first.stdout, re.M), first.stdout[-2000:]

    # make ui serves MLflow (it runs until stopped): its links come first.
    served, running = serve_until_it_answers(ui[0], project, 5000)
    # The UI's web server alone: not MLflow's GenAI job runner and its huey consumers (docs/mlflow.md).
    assert any("uvicorn" in command for command in running), running
    assert not [command for command in running if "huey" in command or "_job_runner" in command], running
    assert re.search(r"modes compared at http://127\.0\.0\.1:5000/#/compare-runs\?runs=%5B%22[0-9a-f]{32}", served)
    assert "the ddp ranks compared at" in served

    workflows = shell("set -e\nsource .venv/bin/activate\n" + "\n".join(blocks("Workflows")), project, timeout=1500)
    assert workflows.returncode == 0, workflows.stdout[-3000:] + workflows.stderr[-3000:]
    shown = workflows.stdout
    assert "classic-3-epochs" in shown and (project / "dvc_plots/index.html").is_file()
    assert "reproduce: reproduced bit for bit" in shown, shown[-3000:]
    shutil.rmtree(project / "dvc_plots")
