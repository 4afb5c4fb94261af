"""Everything about parallelism in one place: devices, rank identity, the process group, wrapping
a model per mode, and launching DDP workers through torchrun's own machinery."""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import re
import signal
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeline.runtime import forkserver
from pipeline.errors import ConfigError, PipelineError

log = logging.getLogger(__name__)
CPU_ONLY_DEFAULT_NPROC = 2
# A rank that waits this long on a peer reports it instead of hanging for torch's default.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class Rank:
    """Who this process is. Only torchrun's env vars define it, so the same code runs under any
    launcher that sets them (torchrun, Slurm or Kubernetes wrappers around torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


WORKER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def under_torchrun() -> bool:
    """True in a worker that torchrun (or a launcher that sets what it sets) started."""
    present = [key for key in WORKER_VARS if key in os.environ]
    if present and len(present) < len(WORKER_VARS):
        # Kubeflow's legacy PyTorchJob runs a plain `python` per pod with RANK and WORLD_SIZE but
        # no LOCAL_RANK. Guessing would pick the wrong GPU, or launch a private job of our own.
        missing = ", ".join(key for key in WORKER_VARS if key not in os.environ)
        raise PipelineError(
            f"{', '.join(present)} set but {missing} not: this process was started by a launcher that "
            "is not torchrun (e.g. Kubeflow's legacy PyTorchJob without torchrun). Start the workers "
            "with torchrun (`torchrun ... -m stages train --mode ddp`, as Kubeflow Trainer's "
            "torch-distributed runtime does), or unset them to let `mnist-pipeline` launch its own")
    return bool(present)


def nodes(rank: Rank) -> int:
    """The machines the job spans (torchrun starts the same number of workers on each)."""
    return rank.world_size // rank.local_world_size


def rank_from_env() -> Rank:
    if not under_torchrun():
        return Rank()
    world_size = int(os.environ["WORLD_SIZE"])
    return Rank(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
    )


def restarted_by_torchrun() -> bool:
    """True in a worker that torchrun restarted after a failure: it should resume, not start over."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


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
    """CUDA_VISIBLE_DEVICES that leaves CUDA no device: empty, or an invalid first entry such as -1
    (CUDA reads the list up to its first invalid entry)."""
    if visible is None:
        return False
    first = visible.split(",")[0].strip()
    return not first or first.startswith("-")


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
            "GPU instance, or all of them in use in exclusive compute mode)")


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


@functools.cache
def cuda_device_count() -> int:
    """The GPUs this process can use. GPUs the driver shows but CUDA cannot use, where the driver is
    older than this torch's CUDA, are an error that names the driver: torch warns once (easy to
    miss) and reports no GPU, and training would go to the CPU. (torch.cuda.device_count() asks NVML
    first, which sees the GPUs whatever the driver's CUDA version, so it cannot tell.) GPUs hidden
    from this process (CUDA_VISIBLE_DEVICES, a job's devices, MIG without instances), or a driver
    whose NVML cannot start: none, and `no_gpu_reason` says why."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        usable = torch.cuda.is_available()  # the CUDA runtime's own count, which fails on an old driver
    too_old = next((found for w in caught if (found := DRIVER_TOO_OLD.search(str(w.message)))), None)
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
    supported = int(too_old.group(1)) if too_old else driver_cuda_version()
    if hides_every_gpu(os.environ.get("CUDA_VISIBLE_DEVICES")) or (
            too_old is None and not driver_too_old(supported, driver[1] if driver else None)):
        no_gpu_reason = hidden(shown)  # the driver could run them, or none is asked for: not this process's
        return 0
    needed = torch.version.cuda or "?"
    floor = DRIVER_FLOOR.get(needed.split(".")[0])
    raise PipelineError(
        "the NVIDIA driver" + (f" {driver[1]}" if driver else "")
        + (f" shows {driver[0]} GPU(s)" if driver else "")
        + (f", supports CUDA {supported // 1000}.{supported % 1000 // 10}" if supported else "")
        + f", but CUDA cannot use them: this torch {torch.__version__} is built for CUDA {needed}"
        + (f", which needs driver {floor} or newer" if floor else "")
        + ". Update the driver, install NVIDIA's CUDA forward-compatibility package, or set "
          "train.device: cpu to train on the CPU")


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


def pick_device(rank: Rank, wanted: str = "auto") -> torch.device:
    """One process per device: CUDA device `local_rank` when CUDA is present (`wanted`: auto or
    cuda), else the CPU (auto or cpu). `cuda` without a visible GPU is an error, not a silent CPU run."""
    if wanted == "cpu" or not gpus_as_wanted(wanted, f"rank {rank.rank}"):
        return torch.device("cpu")
    count = cuda_device_count()
    if rank.local_rank >= count:
        raise PipelineError(
            f"rank {rank.rank}: local rank {rank.local_rank} has no GPU (this node has {count}); "
            f"start at most {count} workers per node (train.nproc or torchrun --nproc-per-node)"
        )
    check_capabilities(f"rank {rank.rank}", count)
    torch.cuda.set_device(rank.local_rank)
    return torch.device("cuda", rank.local_rank)


def runs_here(capability: tuple[int, int], archs: Sequence[str]) -> bool:
    """Whether a GPU of compute `capability` runs kernels built for `archs` (torch.cuda's arch list):
    a cubin for sm_XY runs on X.Z for Z >= Y (sm_XYa only on X.Y), PTX for compute_XY on X.Y or
    newer, compiled when loaded."""
    major, minor = capability
    for arch in archs:
        kind, _, number = arch.partition("_")
        digits = number.rstrip("af")
        if not digits.isdigit():
            continue
        built = (int(digits) // 10, int(digits) % 10)
        if kind == "compute" and built <= capability:
            return True
        if kind == "sm" and (built == capability or (digits == number and built[0] == major and built[1] <= minor)):
            return True
    return False


def check_capabilities(who: str, count: int) -> None:
    """Every GPU this process sees is one these wheels have kernels for: otherwise the first kernel
    fails deep inside training with "no kernel image is available" (V100s, sm_70, under wheels
    built for sm_75 and newer). Asked of the process that trains on them, where CUDA may start."""
    archs = torch.cuda.get_arch_list()
    for index in range(count):
        capability = torch.cuda.get_device_capability(index)
        if archs and not runs_here(capability, archs):
            major, minor = capability
            raise PipelineError(
                f"{who}: cuda:{index} ({torch.cuda.get_device_name(index)}) has compute capability {major}.{minor}, "
                f"and this torch {torch.__version__} has no kernels for it (built for {' '.join(archs)}): train on "
                f"GPUs it is built for, install a torch built for sm_{major}{minor}, or set train.device: cpu")


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cgroup_cpu_limit(cpu_max: Path = CGROUP_CPU_MAX) -> float | None:
    """The CPUs a cgroup v2 quota allows (`docker run --cpus`, a Kubernetes CPU limit), or None."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def available_cpus() -> int:
    """The CPUs this process may really use: its affinity (taskset, Slurm's cpusets) and its
    cgroup quota, not the machine's count, which os.cpu_count() gives."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({available_cpus()} cores)"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def limit_cpu_threads(rank: Rank) -> int:
    """Share the usable cores between the ranks on this node so they never oversubscribe them."""
    threads = max(1, available_cpus() // rank.local_world_size)
    torch.set_num_threads(threads)
    return threads


def default_nproc(wanted: str = "auto") -> int:
    """One worker per GPU, or CPU_ONLY_DEFAULT_NPROC where there is none (or train.device: cpu)."""
    return (0 if wanted == "cpu" else cuda_device_count()) or CPU_ONLY_DEFAULT_NPROC


def check_world_size(global_batch: int, world_size: int) -> None:
    """Every rank needs a sample of every full batch; any world size up to the batch has one."""
    if world_size > global_batch:
        raise ConfigError(
            f"train.batch_size = {global_batch} is smaller than the {world_size} DDP ranks, so some ranks would "
            f"train on nothing: raise train.batch_size to at least {world_size}, or start at most "
            f"{global_batch} workers (train.nproc, train.nodes)")


# Docker's default /dev/shm. NCCL keeps buffers there for the GPUs of one host that talk through
# host memory; at several GPUs a container, a /dev/shm this small fails NCCL's first collective with
# "unhandled system error ... Error while creating shared memory segment".
DOCKER_DEFAULT_SHM_BYTES = 64 * 2**20


def small_shm(local_ranks: int, path: str = "/dev/shm") -> str | None:
    """A warning, said before NCCL workers start, when `path` is no larger than Docker's default
    and several ranks share this host; None otherwise (or where it cannot be measured)."""
    if local_ranks < 2:
        return None
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    size = stats.f_blocks * stats.f_frsize
    if size > DOCKER_DEFAULT_SHM_BYTES:
        return None
    return (f"{path} holds {size / 2**20:.0f} MiB, no more than a container's default: NCCL between {local_ranks} "
            "GPUs of one host may fail with 'unhandled system error' when it makes its buffers there; run the "
            "container with --ipc=host or --shm-size=1g")


def ddp_layout(train) -> tuple[int, int]:
    """(workers per node, nodes) of the DDP training that `train` (config.TrainConfig) starts."""
    workers = train.nproc or (1 if train.launcher == "slurm" else default_nproc(train.device))
    return workers, train.nodes if train.launcher == "slurm" else 1


def check_every_mode(train, mode: str | None = None) -> None:
    """What would fail a later mode fails before the first training (commcheck, then every train
    stage): found in seconds, not after the modes before it trained for hours. `mode`: the one
    about to train, checked whether train.modes lists it or not (`train --mode ddp` by hand)."""
    if "ddp" in train.modes or mode == "ddp":
        workers, nodes = ddp_layout(train)
        try:
            check_world_size(train.batch_size, workers * nodes)
        except ConfigError as exc:
            raise ConfigError(f"ddp{' (in train.modes)' if 'ddp' in train.modes else ''}: {exc}") from None


def batch_shares(batch: int, world_size: int) -> list[int]:
    """How many samples of a `batch`-sample global batch each DDP rank takes: rank r takes
    positions r, r + W, r + 2W, ... (see `pipeline.loop.rank_share`), so the shares differ by at
    most one, the first `batch % W` ranks holding the extra sample (128 on 3 ranks: 43/43/42)."""
    return [len(range(r, batch, world_size)) for r in range(world_size)]


def dp_shares(batch: int, devices: int) -> list[int]:
    """How DataParallel splits a batch over its devices: torch.chunk's pieces (its scatter calls
    chunk), which can differ by more than one (128 on 5 GPUs: 26/26/26/26/24) and can number fewer
    than the devices for a batch that small. DataParallel computes the loss on the gathered
    outputs, so the split never changes what it trains."""
    return [len(piece) for piece in torch.arange(batch).chunk(devices)]


def shares_label(shares: Sequence[int]) -> str:
    """What the report, the metrics and MLflow show for a split batch: '43/43/42', or for more than
    8 shares runs of equal ones, '6x8/5x16' (24 ranks)."""
    if len(shares) <= 8:
        return "/".join(str(share) for share in shares)
    runs: list[list[int]] = []
    for share in shares:
        if runs and runs[-1][0] == share:
            runs[-1][1] += 1
        else:
            runs.append([share, 1])
    return "/".join(f"{share}x{count}" if count > 1 else str(share) for share, count in runs)


def _attempt_store(rank: Rank) -> dist.Store:
    """torchrun's store, under a prefix of its own for each restart attempt.

    The elastic agent keeps one store across restarts, so without a prefix the workers of a
    restarted attempt read the peer addresses the failed attempt left there and fail to connect.
    """
    from torch.distributed.rendezvous import _create_c10d_store

    store = _create_c10d_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank.rank,
                               rank.world_size, timeout=PROCESS_GROUP_TIMEOUT)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"mnist-pipeline/attempt-{attempt}", store)


@contextmanager
def process_group(rank: Rank, device: torch.device) -> Iterator[None]:
    """The one place the process group is set up and torn down, whatever happens in between."""
    if dist.is_initialized():
        # The launcher made the group (Ray Train's TorchTrainer does, then runs training in a
        # thread): use it as it is, and leave it to the launcher to tear down.
        if dist.get_world_size() != rank.world_size or dist.get_rank() != rank.rank:
            raise PipelineError(
                f"rank {rank.rank}: the process group already set up is rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but RANK/WORLD_SIZE say {rank.rank} of {rank.world_size}")
        log.info("using the process group the launcher set up (%s)", dist.get_backend())
        yield
        return
    backend = backend_for(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=_attempt_store(rank), rank=rank.rank, world_size=rank.world_size,
                            timeout=PROCESS_GROUP_TIMEOUT, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


def wrap(model: nn.Module, mode: str, device: torch.device) -> nn.Module:
    """The model as each mode trains it; `unwrap` gives back the module that holds the weights."""
    if mode == "dp":
        if device.type != "cuda":
            log.warning("dp: no CUDA device, so DataParallel has nothing to split; training the bare module on the CPU")
            return model
        return nn.DataParallel(model)
    if mode == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return model.module
    return model


def dp_device_count(device: torch.device) -> int:
    """How many devices DataParallel splits each batch across (1: the bare module)."""
    return torch.cuda.device_count() if device.type == "cuda" else 1


def broadcast_object(value, rank: Rank, src: int = 0):
    """A value made on rank `src` (a run id, a checkpoint), the same on every rank."""
    if rank.world_size == 1:
        return value
    box = [value if rank.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(value, rank: Rank) -> list:
    if rank.world_size == 1:
        return [value]
    gathered = [None] * rank.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def launch_workers(nproc: int, entrypoint: Callable[..., None], args: Sequence[str]) -> None:
    """Run `entrypoint(*args)` as `nproc` torchrun workers on this node and wait for them all.

    This is what `torchrun --standalone --nproc-per-node N` does, through its Python API, so the
    workers see exactly the environment an outer torchrun would give them. Each worker is a fork
    of the preloaded fork server (pipeline.runtime.forkserver), not a fresh interpreter: it starts with its
    imports done.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"{RUN_ID_PREFIX}{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        # The workers reach the agent's store at this address; the host name it would otherwise
        # advertise may not resolve (containers without their name in /etc/hosts).
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.2,
        start_method=forkserver.START_METHOD,
    )
    # For a worker started as a function, the agent logs its failure with a traceback of its own
    # bookkeeping (ProcessExitedException); the worker has said why already, and the error below
    # names it: the line stays, the traceback goes.
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(_without_traceback)
    try:
        elastic_launch(config, entrypoint=entrypoint)(*args)
    except ChildFailedError as exc:
        server = forkserver.server_end()
        if server is not None:  # every worker's end reads "exit code 255" then, whatever it did
            pid, how = server
            raise PipelineError(
                f"the fork server that started the ddp workers (process {pid}) {how} (the out-of-memory killer, or "
                "another program), and every worker was stopped with it; see `dmesg` or the system log for why, "
                "then run again") from None
        failures = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(exc.failures.items()))
        raise PipelineError(f"ddp worker(s) failed: {failures}; see the worker's message above") from None
    except SignalException as exc:
        # This launcher was signalled (Ctrl-C, a container stopped, a scheduler's pre-emption), and
        # the agent has stopped every worker with the same signal: it exits as a signalled process.
        log.error("stopped by %s; every worker was stopped with it", signal.Signals(exc.sigval).name)
        raise SystemExit(128 + exc.sigval) from None
    finally:
        agent_log.removeFilter(_without_traceback)


def _without_traceback(record: logging.LogRecord) -> bool:
    record.exc_info = record.exc_text = None
    return True
