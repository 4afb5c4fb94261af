"""Mechanisms that differ on CUDA, proven where the CPU can run them: autocast inside DataParallel's
replica threads, and saved files that load anywhere."""

import threading

import pytest
import torch
from torch import nn

from pipeline.atomic import save_torch
from pipeline.model import build_model
from pipeline.precision import AutocastForward, autocast_dtype, with_autocast


def forward_like_a_replica(module: nn.Module, images: torch.Tensor) -> torch.dtype:
    """What torch.nn.parallel.parallel_apply does in each replica's thread: a fresh thread that
    re-enters autocast with only `enabled=True`, so the thread's default dtype applies."""
    seen = {}

    def replica() -> None:
        with torch.autocast("cpu", enabled=True):
            seen["dtype"] = module(images).dtype

    thread = threading.Thread(target=replica)
    thread.start()
    thread.join()
    return seen["dtype"]


def test_a_replica_thread_computes_in_the_configured_dtype_not_the_thread_default():
    images = torch.randn(4, 1, 28, 28)
    # The CPU's autocast default is bfloat16, as CUDA's is float16; configure the other one.
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    model = build_model("small")
    assert forward_like_a_replica(model, images) == torch.bfloat16  # the trap: the thread's default
    assert forward_like_a_replica(AutocastForward(model, "cpu", torch.float16), images) == torch.float16


def test_no_autocast_without_a_gpu_that_computes_bf16():
    model = build_model("small")
    assert autocast_dtype(torch.device("cpu"), bf16=True) is None
    assert with_autocast(model, torch.device("cpu"), None) is model


def test_saved_files_hold_cpu_contiguous_tensors_and_load_with_weights_only(tmp_path):
    model = build_model("small").to(memory_format=torch.channels_last)  # as CUDA training keeps it
    conv = model[3].weight
    assert not conv.is_contiguous()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1, 28, 28).contiguous(memory_format=torch.channels_last)).sum().backward()
    optimizer.step()
    save_torch(tmp_path / "checkpoint.pt", {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                            "history": [{"epoch": 1, "loss": 0.5}]})
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    tensors = list(state["model"].values()) + [t for s in state["optimizer"]["state"].values()
                                               for t in s.values() if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
    assert torch.equal(state["model"]["3.weight"], conv.detach())
    fresh = build_model("small")
    fresh.load_state_dict(state["model"])


def test_gpu_check_says_plainly_when_there_is_no_gpu():
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env

    if torch.cuda.is_available():
        import pytest
        pytest.skip("a CUDA host: `make gpu-check` proves the GPU paths there")
    result = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "no CUDA device on this host; nothing proven" in result.stdout
    for check in ("test_bf16_inside_every_dataparallel_replica", "test_ddp_on_every_gpu_agrees_with_single",
                  "dvc repro (default params, all of MNIST)"):
        assert any(line.startswith(check) and " skipped " in line for line in result.stdout.splitlines()), check
    assert " passed " not in result.stdout
    # Every CUDA test is named as the proof of a mechanism, and every named check ran (or was skipped).
    import ast

    from scripts.gpu_check import MECHANISMS

    tests = {node.name for node in ast.parse((ROOT / "tests/test_cuda.py").read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    assert tests == {check for _, check in MECHANISMS if check.startswith("test_")}
    for _, check in MECHANISMS:
        assert check in result.stdout, check


def test_cpu_threads_follow_the_cpus_this_process_may_use():
    import shutil
    import subprocess
    import sys

    import pytest

    from tests.conftest import ROOT, subprocess_env

    if shutil.which("taskset") is None:
        pytest.skip("util-linux taskset is not installed")
    code = ("from pipeline.parallel import Rank, available_cpus, device_name, limit_cpu_threads; import torch; "
            "print(available_cpus(), limit_cpu_threads(Rank(0, 0, 1, 1)), device_name(torch.device('cpu')))")
    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(),
                            capture_output=True, text=True, check=True)
    assert pinned.stdout.split() == ["1", "1", "cpu", "(1", "cores)"]


def test_a_cgroup_cpu_quota_caps_the_cpus(tmp_path):
    from pipeline.parallel import cgroup_cpu_limit

    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # docker run --cpus 1.5
    assert cgroup_cpu_limit(cpu_max) == 1.5
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpu_limit(cpu_max) is None
    assert cgroup_cpu_limit(tmp_path / "absent") is None


@pytest.mark.fast
def test_a_folder_made_by_another_process_between_two_looks_is_not_a_file_in_the_way(tmp_path, monkeypatch):
    """DDP's rank 0 checks models/ddp/logs while rank 1 makes it: a folder that appears between
    in_the_way's two looks is a folder, not "a file in the way" (a full run failed on that)."""
    from pathlib import Path

    from pipeline.atomic import in_the_way
    from pipeline.errors import PipelineError

    logs = tmp_path / "models/ddp/logs"
    real_is_dir, looks = Path.is_dir, []

    def made_meanwhile(path):  # the first look at logs comes before the other process makes it
        if path == logs and not looks:
            looks.append(path)
            logs.mkdir(parents=True)
            return False
        return real_is_dir(path)

    monkeypatch.setattr(Path, "is_dir", made_meanwhile)
    in_the_way(logs)
    assert looks == [logs]
    monkeypatch.undo()
    (tmp_path / "models/single").mkdir(parents=True)
    (tmp_path / "models/single/logs").write_text("a file")
    with pytest.raises(PipelineError, match=r"models/single/logs: a file is in the way"):
        in_the_way(tmp_path / "models/single/logs")
