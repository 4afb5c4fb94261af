"""Which device trains: train.device, a driver too old for this torch's CUDA, and a host whose driver
libraries are present but whose NVML cannot start."""

import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pipeline import gpus, parallel
from pipeline.errors import PipelineError
from pipeline.parallel import Rank
from tests.conftest import ROOT, build_stand_in_driver, subprocess_env, train_cli

# c10/cuda/CUDAFunctions.cpp's message, as torch's device count warns it (both parts are checked
# against the library below, so a torch that words it otherwise fails here first).
TOO_OLD = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12020). Please update "
           "your GPU driver by downloading and installing a new version from the URL: "
           "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org to install a "
           "PyTorch version that has been compiled with your version of the CUDA driver.")


def test_torch_words_an_old_driver_as_the_check_expects():
    library = (Path(torch.__file__).parent / "lib" / "libc10_cuda.so").read_bytes()
    assert b"CUDA initialization: " in library
    assert b"The NVIDIA driver on your system is too old (found version " in library


@pytest.mark.fast
def test_a_driver_too_old_is_an_error_naming_both_versions(monkeypatch):
    """torch's runtime count warns and reports no GPU, while the driver (NVML) shows two; training
    would go to the CPU. The pipeline refuses, naming the driver."""
    def is_available() -> bool:
        warnings.warn(TOO_OLD, UserWarning)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(gpus, "driver_gpus", lambda: (2, "535.104.05"))
    gpus.cuda_device_count.cache_clear()
    try:
        with pytest.raises(PipelineError, match=r"the NVIDIA driver 535\.104\.05 shows 2 GPU\(s\), supports CUDA 12\.2, "
                                                r"but CUDA cannot use them: this torch .* built for CUDA 13\.0, which "
                                                r"needs driver 580 or newer\. Update the driver"):
            parallel.pick_device(Rank(), "auto")
        assert parallel.pick_device(Rank(), "cpu").type == "cpu"  # asked for the CPU: no GPU question
        assert parallel.default_nproc("cpu") == parallel.CPU_ONLY_DEFAULT_NPROC
    finally:
        gpus.cuda_device_count.cache_clear()


def test_gpus_the_driver_shows_but_cuda_cannot_use_are_an_error_even_without_the_warning(monkeypatch):
    """torch warns once a process: a second look gets no warning, but the driver still shows GPUs,
    and its version (without libcuda to ask its CUDA version) is below the wheels' floor."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpus, "driver_gpus", lambda: (8, "550.54"))
    monkeypatch.setattr(gpus, "driver_cuda_version", lambda: None)
    gpus.cuda_device_count.cache_clear()
    try:
        with pytest.raises(PipelineError, match=r"the NVIDIA driver 550\.54 shows 8 GPU\(s\), but CUDA cannot use them"):
            parallel.pick_device(Rank(), "auto")
    finally:
        gpus.cuda_device_count.cache_clear()


# c10/cuda/CUDAFunctions.cpp's words for CUDA that could not start on a new enough driver, as torch's
# device count warns them: here, NVSwitch's fabric manager not running (cudaErrorSystemNotReady).
NOT_READY = ("CUDA initialization: Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions "
             "before calling NumCudaDevices() that might have already set an error? Error 802: system not yet "
             "initialized")


def test_cuda_that_cannot_start_on_a_new_driver_is_an_error_with_torchs_reason(monkeypatch):
    """Not "hidden", not the CPU: the GPUs are this process's, and CUDA failed on them. Without libcuda
    (a container without the compute capability) the same, naming it."""
    assert b"Unexpected error from cudaGetDeviceCount()" in (Path(torch.__file__).parent / "lib" / "libc10_cuda.so").read_bytes()

    def is_available() -> bool:
        warnings.warn(NOT_READY, UserWarning)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(gpus, "driver_gpus", lambda: (8, "580.95.05"))
    monkeypatch.setattr(gpus, "driver_cuda_version", lambda: 13000)
    gpus.cuda_device_count.cache_clear()
    try:
        with pytest.warns(UserWarning, match="Error 802"), pytest.raises(
                PipelineError, match=r"the NVIDIA driver 580\.95\.05 shows 8 GPU\(s\), but CUDA cannot start on them "
                                     r"\(Unexpected error from cudaGetDeviceCount\(\)\)\. Check them with nvidia-smi"):
            parallel.pick_device(Rank(), "auto")
        gpus.cuda_device_count.cache_clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(gpus, "driver_cuda_version", lambda: None)
        with pytest.raises(PipelineError, match=r"shows 8 GPU\(s\), but its CUDA library \(libcuda\.so\.1\) is not here"):
            parallel.pick_device(Rank(), "auto")
    finally:
        gpus.cuda_device_count.cache_clear()


def test_other_cuda_warnings_still_reach_the_user(monkeypatch):
    def is_available() -> bool:
        warnings.warn("CUDA initialization: something else", UserWarning)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(gpus, "driver_gpus", lambda: None)
    gpus.cuda_device_count.cache_clear()
    try:
        with pytest.warns(UserWarning, match="something else"):
            assert parallel.pick_device(Rank(), "auto").type == "cpu"
    finally:
        gpus.cuda_device_count.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host: auto picks its GPU")
def test_cuda_without_a_gpu_is_an_error_and_auto_is_the_cpu():
    assert parallel.pick_device(Rank(), "auto").type == "cpu"
    with pytest.raises(PipelineError, match="rank 3: train.device is cuda, but no GPU is visible"):
        parallel.pick_device(Rank(rank=3, local_rank=1, world_size=4, local_world_size=2), "cuda")


@pytest.fixture
def nvml_cannot_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpus, "driver_gpus", lambda: "Unknown Error")
    for cached in (gpus.cuda_device_count, gpus.say_no_usable_gpu):
        cached.cache_clear()
    yield
    for cached in (gpus.cuda_device_count, gpus.say_no_usable_gpu):
        cached.cache_clear()
    gpus.no_gpu_reason = None


@pytest.mark.fast
def test_nvml_that_cannot_start_is_said_in_one_line_and_auto_trains_on_the_cpu(nvml_cannot_start, caplog,
                                                                               monkeypatch):
    with caplog.at_level(logging.WARNING, logger="pipeline.gpus"):
        assert parallel.pick_device(Rank(), "auto").type == "cpu"
        assert parallel.pick_device(Rank(), "auto").type == "cpu"  # asked again in the same process: said once
    said = [record.getMessage() for record in caplog.records]
    assert said == ["no usable GPU: the NVIDIA driver's libraries are here, but NVML cannot start (Unknown Error), as "
                    "in a container started without --gpus or one whose GPUs were lost; running on the CPU"]
    with pytest.raises(PipelineError, match=r"train.device is cuda, but no GPU is visible: .* NVML cannot start "
                                            r"\(Unknown Error\)"):
        parallel.pick_device(Rank(), "cuda")


@pytest.mark.parametrize("worker_env", [{"TORCHELASTIC_RUN_ID": "mnist-0a1b2c3d", "LOCAL_RANK": "0"},
                                        {"TORCHELASTIC_RUN_ID": "outer", "LOCAL_RANK": "1"}])
@pytest.mark.fast
def test_the_workers_of_a_launcher_leave_the_line_to_it(nvml_cannot_start, caplog, monkeypatch, worker_env):
    """This pipeline's launcher said it; under an outer torchrun, local rank 0 says it for the node."""
    for key, value in worker_env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="pipeline.gpus"):
        assert parallel.pick_device(Rank(), "auto").type == "cpu"
    assert caplog.records == []


@pytest.fixture(scope="module")
def stand_in_driver(tmp_path_factory) -> Path:
    """A folder holding the stand-in libcuda.so.1 and libnvidia-ml.so.1, for LD_LIBRARY_PATH: built
    once for the file (two gcc runs), which its tests only load."""
    return build_stand_in_driver(tmp_path_factory.mktemp("driver"))


DRIVER_AS_NVML_SEES_IT = "from pipeline.gpus import driver_gpus; print(driver_gpus())"


def test_nvml_is_read_as_the_stand_in_driver_answers(stand_in_driver):
    """The stand-in libnvidia-ml.so.1 (tests/stand_in_libcuda.c), through pynvml as on a GPU host: a
    driver with no GPU, one whose NVML cannot start (999, "Unknown Error", a container without its
    GPUs), and no driver at all."""

    def driver(**env: str) -> str:
        done = subprocess.run([sys.executable, "-c", DRIVER_AS_NVML_SEES_IT], cwd=ROOT, capture_output=True, text=True,
                              env=subprocess_env(**env), timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert driver(LD_LIBRARY_PATH=str(stand_in_driver)) == "(0, '580.00')"
    assert driver(LD_LIBRARY_PATH=str(stand_in_driver), STAND_IN_NVML_INIT="999") == "Unknown Error"
    assert driver(LD_LIBRARY_PATH=str(stand_in_driver), STAND_IN_GPUS="2") == "(2, '580.00')"
    if not any(Path(folder, "libnvidia-ml.so.1").exists() for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64")):
        assert driver() == "None"


@pytest.mark.fast
def test_a_ddp_training_where_nvml_cannot_start_says_so_once_and_trains_on_the_cpu(small_project, stand_in_driver):
    done = train_cli(small_project, "ddp", LD_LIBRARY_PATH=str(stand_in_driver), STAND_IN_NVML_INIT="999")
    output = done.stdout + done.stderr
    assert output.count("NVML cannot start (Unknown Error)") == 1, output[-3000:]
    assert "ddp: 2 process(es) on cpu" in output
    assert (small_project / "models/ddp/model.pt").is_file()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a tmpfs")
@pytest.mark.parametrize("size, warned", [("64m", True), ("1g", False)])
def test_a_container_sized_dev_shm_is_said_before_nccl_workers_start(size, warned):
    """A real tmpfs of Docker's default size on /dev/shm, in a mount namespace of its own."""
    code = "from pipeline.parallel import small_shm; print(small_shm(8)); print(small_shm(1))"
    done = subprocess.run(["unshare", "--mount", "sh", "-c",
                           f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} -c '{code}'"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    eight, one = done.stdout.splitlines()
    assert one == "None"  # one rank a host: nothing to share
    if warned:
        assert eight.startswith("/dev/shm holds 64 MiB") and "--ipc=host or --shm-size=1g" in eight, eight
    else:
        assert eight == "None"


PICK = ("import logging; logging.basicConfig(format='%(message)s')\n"
        "from pipeline.parallel import Rank, pick_device\n"
        "print('device:', pick_device(Rank(), '{wanted}'))")


def pick_on_the_stand_in(folder: Path, wanted: str = "auto", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PICK.format(wanted=wanted)], cwd=ROOT, capture_output=True, text=True,
                          env=subprocess_env(LD_LIBRARY_PATH=str(folder), STAND_IN_GPUS="2", **env), timeout=120)


# One case in the fast tier (each is two processes that import torch); the suite runs them all.
@pytest.mark.parametrize("visible, cause", [
    pytest.param("", "CUDA_VISIBLE_DEVICES='' hides the 2 GPU(s) the NVIDIA driver shows", marks=pytest.mark.fast),
    ("-1", "CUDA_VISIBLE_DEVICES='-1' hides the 2 GPU(s) the NVIDIA driver shows"),
    ("NoDevFiles", "CUDA_VISIBLE_DEVICES='NoDevFiles' hides the 2 GPU(s)"),
    (None, "the NVIDIA driver shows 2 GPU(s), but "),
])
def test_gpus_hidden_from_the_process_are_not_an_old_driver(stand_in_driver, visible, cause):
    """The stand-in driver shows 2 GPUs (NVML ignores CUDA_VISIBLE_DEVICES) that CUDA cannot use:
    hidden by CUDA_VISIBLE_DEVICES, or with no device file open to the process (a Slurm job that
    asked for none, MIG without instances), auto trains on the CPU and says why in one line; cuda
    is refused naming the same cause. Only a driver whose CUDA is older than the wheels' is blamed."""
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    done = pick_on_the_stand_in(stand_in_driver, **env)
    assert done.returncode == 0 and done.stdout.strip() == "device: cpu", done.stderr[-2000:]
    said = done.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"no usable GPU: {cause}"), said
    refused = pick_on_the_stand_in(stand_in_driver, "cuda", **env)
    assert refused.returncode == 1 and f"train.device is cuda, but no GPU is visible: {cause}" in refused.stderr
    assert "Update the driver" not in done.stderr + refused.stderr


def test_a_driver_older_than_the_wheels_is_blamed_unless_no_gpu_is_asked_for(stand_in_driver):
    """A driver whose CUDA is older than the wheels' (12.2 against 13.0) is still the driver's fault,
    unless CUDA_VISIBLE_DEVICES asks for no GPU at all (reproduce's advice for a CPU run)."""
    old = {"STAND_IN_CUDA_VERSION": "12020", "STAND_IN_DRIVER_VERSION": "535.104.05"}
    done = pick_on_the_stand_in(stand_in_driver, **old)
    assert done.returncode == 1 and ("PipelineError: the NVIDIA driver 535.104.05 shows 2 GPU(s), supports CUDA 12.2, "
                                     "but CUDA cannot use them") in done.stderr, done.stderr[-2000:]
    assert pick_on_the_stand_in(stand_in_driver, CUDA_VISIBLE_DEVICES="", **old).stdout.strip() == "device: cpu"


@pytest.mark.fast
@pytest.mark.parametrize("line, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023", "535.104.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
     "(dvs-builder@U22-I3-AF03-09-1)  Tue Sep 23 09:52:27 UTC 2025", "580.95.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.65.06  Release Build  "
     "(dvs-builder@U16-I2-C03-12-4)  Sun Jul 27 06:54:38 UTC 2025", "580.65.06"),
    ("", "unknown"),
])
def test_the_driver_version_is_read_from_either_kind_of_kernel_module(tmp_path, line, version):
    """NVIDIA's open kernel modules (the default since R560, the only kind on Blackwell) word their
    line "... Open Kernel Module for x86_64  580.xx": the version, not "for"."""
    from pipeline.record import driver_version

    (tmp_path / "version").write_text(f"{line}\nGCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n")
    assert driver_version(tmp_path / "version") == version
    assert driver_version(tmp_path / "absent") == "unknown"


# GPUs a team may have, by compute capability, and whether the locked wheels (sm_75, 80, 86, 90, 100
# and 120 cubins, no PTX) have kernels for them: NVIDIA's compatibility rules, written out.
WHEEL_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
CAPABILITIES = {(6, 0): False,  # P100
                (7, 0): False,  # V100
                (7, 5): True,  # T4
                (8, 0): True, (8, 6): True, (8, 9): True,  # A100, A10, L4 (sm_86's cubin)
                (8, 7): False,  # Jetson Orin: an integrated GPU, its own kernels only
                (9, 0): True, (10, 0): True, (10, 3): True,  # H100, B200, B300 (sm_100's)
                (11, 0): False,  # Thor
                (12, 0): True, (12, 1): True}  # RTX PRO 6000, DGX Spark (sm_120's)


@pytest.mark.fast
def test_gpus_the_wheels_have_no_kernels_for_are_refused_at_the_start(monkeypatch):
    archs = torch.cuda.get_arch_list()
    assert archs == WHEEL_ARCHS, archs  # the lock's wheels: another torch needs the table above redone
    assert {capability: gpus.runs_here(capability, archs) for capability in CAPABILITIES} == CAPABILITIES
    assert not gpus.runs_here((8, 9), ["sm_87"])  # an integrated GPU's kernels are for it alone
    assert not gpus.runs_here((9, 0), ["sm_86"]) and gpus.runs_here((9, 0), ["sm_86", "compute_86"])
    assert gpus.runs_here((9, 0), ["sm_90a"]) and not gpus.runs_here((10, 0), ["sm_90a"])
    assert gpus.runs_here((10, 3), ["sm_100f"]) and not gpus.runs_here((12, 0), ["sm_100f"])  # a family's later minors
    assert not gpus.runs_here((10, 0), ["compute_90a"]) and gpus.runs_here((10, 0), ["compute_90"])
    assert not gpus.runs_here((8, 7), archs) and not gpus.runs_here((11, 0), archs)  # Jetson Orin, Thor: their own

    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: [(9, 0), (7, 0)][index])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: ["NVIDIA H100", "Tesla V100-SXM2-32GB"][index])
    gpus.check_capabilities("rank 0", [0])
    with pytest.raises(PipelineError, match=r"^rank 0: cuda:1 \(Tesla V100-SXM2-32GB\) has compute capability 7\.0, "
                                            r"and this torch .* has no kernels for it \(built for sm_75 .* sm_120\)"):
        gpus.check_capabilities("rank 0", [0, 1])
    # DataParallel's process runs kernels on every GPU: each is checked, not only its own.
    monkeypatch.setattr(gpus, "gpus_as_wanted", lambda wanted, who: True)
    monkeypatch.setattr(gpus, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    assert parallel.pick_device(Rank(), "auto") == torch.device("cuda", 0)
    with pytest.raises(PipelineError, match=r"^rank 0: cuda:1 \(Tesla V100-SXM2-32GB\)"):
        parallel.pick_device(Rank(), "auto", every_gpu=True)
