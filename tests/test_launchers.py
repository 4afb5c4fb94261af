"""Launchers other than torchrun, as they really start a worker: a legacy Kubeflow PyTorchJob pod
(RANK and WORLD_SIZE, no LOCAL_RANK) is refused; a Ray Train worker (the process group already
made, training run in a thread) trains the same weights as torchrun's workers."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import (
    ROOT,
    free_port,
    load_weights,
    max_abs_diff,
    project_env,
    subprocess_env,
    train_cli,
)


def test_a_pytorchjob_pod_without_local_rank_is_refused(small_project):
    """Kubeflow's legacy PyTorchJob runs `python -m stages train --mode ddp` in every pod with
    RANK/WORLD_SIZE/MASTER_*: it used to launch a private 2-process job and record world size 2."""
    result = train_cli(small_project, "ddp", check=False, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()))
    assert result.returncode == 1
    assert "RANK, WORLD_SIZE set but LOCAL_RANK not" in result.stderr and "torchrun" in result.stderr
    assert "launching" not in result.stdout and "Traceback" not in result.stderr


RAY_LIKE_WORKER = textwrap.dedent("""
    # What Ray Train's TorchTrainer does in each worker: set torch's variables, make the process
    # group itself, then run the training function in a thread that is not the main one.
    import os, sys, threading
    import torch.distributed as dist
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from stages.cli import main
    outcome = {}
    def train():
        try:
            main(["train", "--mode", "ddp"], standalone_mode=False)
            outcome["ok"] = True
        except BaseException as exc:
            outcome["error"] = repr(exc)
    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    assert outcome.get("ok"), outcome
    assert dist.is_initialized(), "the launcher's process group was torn down under it"
    dist.destroy_process_group()
    print("worker done")
""")


def test_a_ray_train_worker_reuses_its_process_group_and_trains_in_a_thread(small_project, tmp_path):
    train_cli(small_project, "ddp")  # torchrun's workers, the reference
    reference = load_weights(small_project, "ddp")
    (small_project / "models/ddp/model.pt").unlink()
    script = tmp_path / "ray_like_worker.py"
    script.write_text(RAY_LIKE_WORKER)
    env = subprocess_env(**project_env(small_project, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    workers = [subprocess.Popen([sys.executable, str(script), str(r), "2"], cwd=small_project, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    for worker, out in zip(workers, outputs):
        assert worker.returncode == 0 and "worker done" in out, out[-4000:]
    assert "using the process group the launcher set up (gloo)" in outputs[0]
    assert max_abs_diff(reference, load_weights(small_project, "ddp")) == 0.0


def test_the_library_never_imports_its_front_end():
    """pipeline/ is the library, stages/ the CLI on top of it: imports go one way only (but for
    pipeline/__main__.py, the entry point `python -m pipeline`, which nothing imports)."""
    offenders = []
    for path in sorted(set((ROOT / "pipeline").glob("*.py")) - {ROOT / "pipeline/__main__.py"}):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] == "stages"]
    assert offenders == []


@pytest.mark.fast
def test_python_m_pipeline_and_python_m_stages_are_the_cli():
    for package in ("pipeline", "stages"):
        result = subprocess.run([sys.executable, "-m", package, "--help"], cwd=ROOT, capture_output=True, text=True,
                                env=subprocess_env())
        assert result.returncode == 0, result.stderr
        for command in ("prepare", "commcheck", "train", "evaluate", "compare", "send-runs"):
            assert command in result.stdout


def test_compare_and_send_runs_never_load_torch():
    # Every stage is a process of its own, and importing torch is seconds of a small stage's start.
    code = "import sys, stages.cli, stages.compare, stages.send_runs; print(sorted({'torch', 'mlflow'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=subprocess_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
