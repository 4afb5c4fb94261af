"""Which GPUs this process can use, asked without starting CUDA where that matters: the driver's
own view (NVML, libcuda's CUDA version), CUDA's count, why there is none (hidden from the process,
NVML that cannot start), a driver too old for these wheels, and GPUs they have no kernels for.
Each failure is one line that names its cause, before any worker starts or any tensor moves."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Sequence

import torch

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)


# torch's words when the driver is older than its CUDA (c10/cuda/CUDAFunctions.cpp); the number is
# the CUDA version the driver supports, as cudaDriverGetVersion gives it (12020: CUDA 12.2).
DRIVER_TOO_OLD = re.compile(r"driver on your system is too old \(found version (\d+)\)")
# The oldest NVIDIA driver for each CUDA major version of the wheels (NVIDIA's release notes).
DRIVER_FLOOR = {"12": 525, "13": 580}


def driver_gpus() -> tuple[int, str] | str | None:
    """(GPUs, driver version) as the NVIDIA driver itself reports them through NVML, which works
    whatever CUDA version the driver supports; None without a driver (no libnvidia-ml); NVML's own
    error where its library loads but cannot start: a container started without --gpus that has
    the driver's libraries anyway, or one whose GPUs were lost ("Unknown Error")."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return None
    except pynvml.NVMLError as exc:
        return str(exc)
    try:
        return pynvml.nvmlDeviceGetCount(), pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


# The run id of the workers this pipeline's launcher starts (launch_workers): the launcher has said
# whatever it found out about the host, which its workers then need not repeat.
RUN_ID_PREFIX = "mnist-"
# Why the GPUs the driver has are no use to this process (set by cuda_device_count): NVML cannot
# start, or they are hidden from it. None where there is no driver, or CUDA uses its GPUs.
no_gpu_reason: str | None = None


def nvml_cannot_start(error: str) -> str:
    return (f"the NVIDIA driver's libraries are here, but NVML cannot start ({error}), as in a container started "
            "without --gpus or one whose GPUs were lost")


def driver_cuda_version() -> int | None:
    """The CUDA version the driver supports (12020: CUDA 12.2; with NVIDIA's forward-compatibility
    package, that package's), from libcuda's cuDriverGetVersion, which needs no cuInit: no context,
    no warning. None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    return version.value if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value else None


def gpu_device_files() -> list[Path]:
    return sorted(Path("/dev").glob("nvidia[0-9]*"))


def hides_every_gpu(visible: str | None) -> bool:
    """CUDA_VISIBLE_DEVICES that leaves CUDA no device: CUDA reads the list up to its first entry
    that is neither an index nor a GPU-/MIG- id, so an empty one, -1 or Slurm's NoDevFiles."""
    if visible is None:
        return False
    first = visible.split(",")[0].strip()
    return not (first.isdigit() or first.startswith(("GPU-", "MIG-")))


def hidden(shown: int) -> str:
    """Why CUDA sees none of the `shown` GPUs that the driver (NVML, which ignores
    CUDA_VISIBLE_DEVICES and the devices a job was given) shows, where the driver could run them."""
    gpus = f"{shown} GPU(s)" if shown else "GPUs"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides the {gpus} the NVIDIA driver shows"
    files = gpu_device_files()
    openable = []
    for path in files:
        try:
            os.close(os.open(path, os.O_RDWR))
            openable.append(path)
        except OSError:  # EPERM: a cgroup that confines devices (Slurm's, a container's)
            continue
    if not openable:
        return (f"the NVIDIA driver shows {gpus}, but "
                + ("no /dev/nvidiaN device file is here" if not files else "none of /dev/nvidiaN is open to this process")
                + " (a Slurm job that asked for no GPU, or a container without them)")
    return (f"the NVIDIA driver shows {gpus}, but CUDA can use none of them (GPUs in MIG mode without a "
            "GPU instance)")


@functools.cache
def say_no_usable_gpu() -> None:
    """train.device auto on such a host: one line a node, by the launcher (or a lone process), not
    again by each of its workers."""
    if os.environ.get("TORCHELASTIC_RUN_ID", "").startswith(RUN_ID_PREFIX) or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    log.warning("no usable GPU: %s; running on the CPU", no_gpu_reason)


def driver_too_old(supported: int | None, driver_version: str | None) -> bool:
    """Whether the driver cannot run this torch's CUDA: the CUDA version it supports, else (without
    libcuda to ask) NVML's driver version against the floor of the wheels' CUDA major version."""
    needed = torch.version.cuda
    if not needed:
        return False
    major = int(needed.split(".")[0])
    if supported:
        return supported // 1000 < major
    floor = DRIVER_FLOOR.get(str(major))
    try:
        return floor is not None and driver_version is not None and int(driver_version.split(".")[0]) < floor
    except ValueError:
        return False


# How torch reports CUDA that could not start for another reason (c10/cuda/CUDAFunctions.cpp):
# "CUDA driver initialization failed", "CUDA unknown error", "Unexpected error from
# cudaGetDeviceCount() ... Error 802: system not yet initialized" (NVSwitch's fabric manager down).
CUDA_FAILED = "CUDA initialization: "


@functools.cache
def cuda_device_count() -> int:
    """The GPUs this process can use. Where the driver shows GPUs and CUDA none, why:
    - hidden from this process (CUDA_VISIBLE_DEVICES, a job given none, MIG without instances):
      none, and `no_gpu_reason` says why, as where NVML cannot start;
    - a driver older than this torch's CUDA: an error naming it. torch warns once (easy to miss)
      and reports no GPU, and training would go to the CPU;
    - CUDA that could not start on them (torch's warning says why), or no libcuda: an error too.
    (torch.cuda.device_count() asks NVML first, which sees the GPUs whatever the driver's CUDA
    version or CUDA_VISIBLE_DEVICES, so it cannot tell.)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        usable = torch.cuda.is_available()  # the CUDA runtime's own count, which fails on an old driver
    too_old = next((found for w in caught if (found := DRIVER_TOO_OLD.search(str(w.message)))), None)
    failed = next((str(w.message) for w in caught if str(w.message).startswith(CUDA_FAILED)), None)
    for warning in caught:
        if not DRIVER_TOO_OLD.search(str(warning.message)):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if usable:
        return torch.cuda.device_count()
    global no_gpu_reason
    driver = driver_gpus()
    if isinstance(driver, str):
        no_gpu_reason = nvml_cannot_start(driver)
        driver = None
    shown = driver[0] if driver else 0
    if too_old is None and not shown:
        return 0  # no GPU here
    if hides_every_gpu(os.environ.get("CUDA_VISIBLE_DEVICES")):
        no_gpu_reason = hidden(shown)  # none asked for (reproduce's advice for a CPU run): the driver is no matter
        return 0
    supported = int(too_old.group(1)) if too_old else driver_cuda_version()
    version = f" {driver[1]}" if driver else ""
    if too_old or driver_too_old(supported, driver[1] if driver else None):
        needed = torch.version.cuda or "?"
        floor = DRIVER_FLOOR.get(needed.split(".")[0])
        raise PipelineError(
            f"the NVIDIA driver{version}" + (f" shows {shown} GPU(s)" if shown else "")
            + (f", supports CUDA {supported // 1000}.{supported % 1000 // 10}" if supported else "")
            + f", but CUDA cannot use them: this torch {torch.__version__} is built for CUDA {needed}"
            + (f", which needs driver {floor} or newer" if floor else "")
            + ". Update the driver, install NVIDIA's CUDA forward-compatibility package, or set "
              "train.device: cpu to train on the CPU")
    if supported is None:
        raise PipelineError(
            f"the NVIDIA driver{version} shows {shown} GPU(s), but its CUDA library (libcuda.so.1) is not here: a "
            "container whose NVIDIA_DRIVER_CAPABILITIES leaves out compute, or a driver installed without it. Start "
            "the container with --gpus all (NVIDIA_DRIVER_CAPABILITIES=compute,utility), or set train.device: cpu")
    if failed is not None:
        reason = failed[len(CUDA_FAILED):].split(". ")[0][:200]
        raise PipelineError(
            f"the NVIDIA driver{version} shows {shown} GPU(s), but CUDA cannot start on them ({reason}). Check them "
            "with nvidia-smi (on NVSwitch systems, that nvidia-fabricmanager runs), or set train.device: cpu")
    no_gpu_reason = hidden(shown)  # the driver could run them, and CUDA started: they are not this process's
    return 0


def gpus_as_wanted(wanted: str, who: str = "this process") -> bool:
    """Whether to train on GPUs: there are some and `wanted` is not cpu. `cuda` with none visible
    is an error, not a silent CPU run. Counts the GPUs without touching them, so a launcher can
    ask before it starts workers."""
    if wanted == "cpu":
        return False
    if cuda_device_count():
        return True
    if wanted == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise PipelineError(
            f"{who}: train.device is cuda, but no GPU is visible"
            + (f": {no_gpu_reason}" if no_gpu_reason
               else f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
            + ". Under Slurm the job must ask for GPUs (train.launcher: slurm asks for train.nproc per node); "
              "a container must be started with --gpus all. Or set train.device: auto to train on the CPU")
    if no_gpu_reason:
        say_no_usable_gpu()
    return False



# Integrated GPUs (Jetson's and Thor's) run only kernels built for them, before CUDA 13.2; sm_101
# was renamed sm_110 (torch.cuda.DEVICE_REQUIREMENT).
INTEGRATED = {(5, 3), (6, 2), (7, 2), (8, 7), (10, 1), (11, 0)}
RENAMED = {(10, 1): (11, 0)}


def runs_here(capability: tuple[int, int], archs: Sequence[str]) -> bool:
    """Whether a GPU of compute `capability` runs kernels built for `archs` (torch.cuda's arch list):
    a cubin for sm_XY runs on X.Z for Z >= Y, sm_XYf on its family the same way, sm_XYa only on X.Y;
    PTX for compute_XY on X.Y or newer, compiled when loaded (compute_XYa and XYf as their cubins).
    An integrated GPU runs only what was built for it."""
    capability = RENAMED.get(capability, capability)
    integrated = capability in INTEGRATED and tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2]) < (13, 2)
    for arch in archs:
        kind, _, number = arch.partition("_")
        digits, suffix = number.rstrip("af"), number[len(number.rstrip("af")):]
        if kind not in ("sm", "compute") or not digits.isdigit():
            continue
        built = RENAMED.get((int(digits) // 10, int(digits) % 10), (int(digits) // 10, int(digits) % 10))
        if built == capability:
            return True
        if integrated or suffix == "a" or built in INTEGRATED:  # an integrated GPU's kernels run on it alone
            continue
        if kind == "compute" and not suffix and built < capability:
            return True
        if built[0] == capability[0] and built[1] <= capability[1]:  # sm_XY, sm_XYf, compute_XYf
            return True
    return False


def check_capabilities(who: str, indices: Sequence[int]) -> None:
    """The GPUs this process trains on are ones these wheels have kernels for: otherwise the first
    kernel fails deep inside training with "no kernel image is available" (V100s, sm_70, under
    wheels built for sm_75 and newer). Asked of the process that trains on them, where CUDA may
    start (no context: the properties are the runtime's)."""
    archs = torch.cuda.get_arch_list()
    for index in indices:
        capability = torch.cuda.get_device_capability(index)
        if archs and not runs_here(capability, archs):
            major, minor = capability
            raise PipelineError(
                f"{who}: cuda:{index} ({torch.cuda.get_device_name(index)}) has compute capability {major}.{minor}, "
                f"and this torch {torch.__version__} has no kernels for it (built for {' '.join(archs)}): train on "
                f"GPUs it is built for, install a torch built for sm_{major}{minor}, or set train.device: cpu")
