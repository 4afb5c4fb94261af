"""Everything about parallelism in one place: devices, rank identity, the process group, wrapping
a model per mode, and launching DDP's and FSDP's workers through torchrun's own machinery."""

from __future__ import annotations

import logging
import math
import os
import signal
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeline import gloo_batchnorm, gpus
from pipeline.runtime import forkserver
from pipeline.config import DISTRIBUTED, distributed  # noqa: F401 (distributed: the modes' test, here too)
from pipeline.errors import ConfigError, PipelineError
from pipeline.precision import AutocastForward

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


def launch_id() -> str:
    """What names this launch of the workers, the same across torchrun's restarts of them and a
    Slurm job's requeues (train.sbatch's rendezvous id is the job id); "" outside both."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID", "")


def restarted() -> bool:
    """True in a worker started again after a failure or a preemption, by torchrun or by Slurm (a
    requeued job: deploy/slurm/train.sbatch): it resumes from a checkpoint where one is, not afresh."""
    return restarted_by_torchrun() or int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0


def pick_device(rank: Rank, wanted: str = "auto", every_gpu: bool = False) -> torch.device:
    """One process per device: CUDA device `local_rank` when CUDA is present (`wanted`: auto or
    cuda), else the CPU (auto or cpu). `cuda` without a visible GPU is an error, not a silent CPU run.
    `every_gpu`: the process uses all the visible GPUs (DataParallel), so each must run these kernels."""
    if wanted == "cpu" or not gpus.gpus_as_wanted(wanted, f"rank {rank.rank}"):
        return torch.device("cpu")
    count = gpus.cuda_device_count()
    if rank.local_rank >= count:
        raise PipelineError(
            f"rank {rank.rank}: local rank {rank.local_rank} has no GPU (this node has {count}); "
            f"start at most {count} workers per node (train.nproc or torchrun --nproc-per-node)"
        )
    gpus.check_capabilities(f"rank {rank.rank}", range(count) if every_gpu else [rank.local_rank])
    torch.cuda.set_device(rank.local_rank)
    return torch.device("cuda", rank.local_rank)


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
    return (0 if wanted == "cpu" else gpus.cuda_device_count()) or CPU_ONLY_DEFAULT_NPROC


def check_world_size(global_batch: int, world_size: int, grad_accum_steps: int = 1) -> None:
    """Every rank needs a sample of every full batch, and with gradient accumulation one in each of
    its micro-batches: a share of at least train.grad_accum_steps samples."""
    if world_size > global_batch:
        raise ConfigError(
            f"train.batch_size = {global_batch} is smaller than the {world_size} DDP ranks, so some ranks would "
            f"train on nothing: raise train.batch_size to at least {world_size}, or start at most "
            f"{global_batch} workers (train.nproc, train.nodes)")
    share = global_batch // world_size
    if grad_accum_steps > share:
        where = f"each of {world_size} ranks' shares of" if world_size > 1 else "the"
        raise ConfigError(
            f"train.grad_accum_steps = {grad_accum_steps} micro-batches cannot all hold a sample of {where} "
            f"train.batch_size = {global_batch} ({share} samples{' or more' if global_batch % world_size else ''}): "
            f"lower train.grad_accum_steps to at most {share}, or raise train.batch_size to at least "
            f"{grad_accum_steps * world_size}")


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
    """(workers per node, nodes) of the DDP (or FSDP) training that `train` (config.TrainConfig) starts. Under
    Slurm with train.nproc 0 the job decides (train.sbatch: the GPUs Slurm gave a node, else 1):
    1 here, the fewest it can be, so the checks before the job are a lower bound."""
    workers = train.nproc or (1 if train.launcher == "slurm" else default_nproc(train.device))
    return workers, train.nodes if train.launcher == "slurm" else 1


def check_every_mode(train, mode: str | None = None) -> None:
    """What would fail a later mode fails before the first training (commcheck, then every train
    stage): found in seconds, not after the modes before it trained for hours. `mode`: the one
    about to train, checked whether train.modes lists it or not (`train --mode ddp` by hand)."""
    for each in DISTRIBUTED:
        if each in train.modes or mode == each:
            check_distributed(train, each)


def check_distributed(train, mode: str) -> None:
    workers, nodes = ddp_layout(train)
    listed = " (in train.modes)" if mode in train.modes else ""
    try:
        check_world_size(train.batch_size, workers * nodes, train.grad_accum_steps)
    except ConfigError as exc:
        raise ConfigError(f"{mode}{listed}: {exc}") from None
    if mode != "ddp" or not train.sync_batchnorm:
        return  # SyncBatchNorm is DDP's (pipeline.checkpoint.trajectory: fsdp's is always off)
    if train.grad_accum_steps > 1:
        # SyncBatchNorm meets the other ranks in every micro-batch's forward and backward, and a
        # short last batch can give the ranks different numbers of them (micro_batches drops
        # empty ones): the ranks would wait on each other for good.
        raise ConfigError("train.sync_batchnorm is true with train.grad_accum_steps = "
                          f"{train.grad_accum_steps}: SyncBatchNorm needs every rank to run as many micro-batches, "
                          "which a short last batch does not give; set one of them back")
    # Here, the devices this host has; a Slurm job's node checks its own (pipeline.loop.wrap_for_mode).
    if train.compile and train.launcher == "local" and not gpus.gpus_as_wanted(train.device):
        raise ConfigError(gloo_batchnorm.NOT_COMPILED)


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


def wrap(model: nn.Module, mode: str, device: torch.device, sync_batchnorm: bool = False,
         replicas: int = 1) -> nn.Module:
    """The model as each mode trains it; `unwrap` gives back the module that holds the weights.
    `sync_batchnorm` (ddp): its BatchNorm layers become SyncBatchNorm, in place, with the same
    parameters and buffers (the optimizer's, the checkpoint's), before DDP wraps it: torch's on
    GPUs, pipeline.gloo_batchnorm's on the CPU, where torch's does not run. fsdp shards
    the model in place (`shard`, over `replicas` groups of ranks): its parameters are new ones, so
    the optimizer is built after."""
    if mode == "dp":
        if device.type != "cuda":
            log.warning("dp: no CUDA device, so DataParallel has nothing to split; training the bare module on the CPU")
            return model
        return nn.DataParallel(model)
    if mode == "ddp":
        if sync_batchnorm:
            if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
                log.warning("ddp: train.sync_batchnorm is true, but the model has no BatchNorm layer to sync")
            model = gloo_batchnorm.convert(model, device)
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if mode == "fsdp":
        if sync_batchnorm:
            log.warning("fsdp: train.sync_batchnorm is ddp's alone; fsdp's BatchNorm layers normalise each rank's "
                        "share, their running statistics rank 0's, as ddp's without it")
        return shard(model, device, replicas)
    return model


def shard(model: nn.Module, device: torch.device, replicas: int = 1) -> nn.Module:
    """FSDP2: every parameter split over the ranks of a device mesh, each rank holding 1/W of each
    (dim 0, padded), gathered for a layer's forward and backward and freed after; gradients
    reduce-scattered back to shards. `replicas` > 1 (train.fsdp_sharding: hybrid, one per node): a
    2-D mesh, sharded within each node and replicated across nodes, whose gradients are then
    all-reduced between the replicas (HSDP): each rank holds 1/(W/replicas) of the model, and only
    that all-reduce crosses the slower links between nodes.

    The units gathered one at a time are the network's layers (the children of its containers,
    Sequential and the like, that hold parameters): the next one's all-gather overlaps this one's
    compute. The root holds what is left. The model is changed in place: the result is `model`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if replicas > 1:
        if world % replicas:
            raise PipelineError(f"fsdp: train.fsdp_sharding: hybrid needs as many workers on each of the {replicas} "
                                f"nodes, but {world} ranks do not divide by {replicas}")
        mesh = init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
        for group in mesh.get_all_groups():  # made with the backend's default timeout (30 min on gloo)
            dist.set_timeout(PROCESS_GROUP_TIMEOUT, group)
    else:
        mesh = init_device_mesh(device.type, (world,))
    # FSDP2 shards contiguous parameters only: channels_last (conv weights, on GPUs) goes back to
    # the standard layout; the inputs may stay channels_last, and cuDNN follows them.
    model.to(memory_format=torch.contiguous_format)
    network = model.module if isinstance(model, AutocastForward) else model
    for unit in shard_units(network):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_units(module: nn.Module) -> Iterator[nn.Module]:
    """The layers `shard` gathers one at a time: `module`'s children that hold parameters, looking
    inside containers (Sequential, ModuleList, ModuleDict) for theirs."""
    for child in module.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            yield from shard_units(child)
        elif any(True for _ in child.parameters()):
            yield child


# DDP's bucket size for its own broadcast of the buffers (DistributedDataParallel's _sync_buffers).
BUFFER_BUCKET_BYTES = 250 * 2**20


def broadcast_buffers(model: nn.Module) -> None:
    """What DDP does with buffers (BatchNorm's running statistics) and FSDP2 does not: rank 0's
    sent to every rank, coalesced, before a step's first forward (DDP's rule: after a forward that
    synced gradients), so the ranks go on from one copy. Nothing without buffers."""
    buffers = list(model.buffers())
    if buffers:
        dist._broadcast_coalesced(dist.group.WORLD, buffers, BUFFER_BUCKET_BYTES, 0)


def sharded(model: nn.Module) -> bool:
    """True for a model FSDP2 shards (`shard`): its parameters are DTensors, 1/W on each rank."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict whole: fsdp's shards gathered one tensor at a time (a collective: every
    rank calls it, in the same order) and kept, on the CPU, by rank 0 alone (the others get {}): a
    device holds one whole tensor at a time, never the whole model. Other modes' state dict as it is."""
    from torch.distributed.tensor import DTensor

    state = module.state_dict()
    if not any(isinstance(value, DTensor) for value in state.values()):
        return state
    keep = dist.get_rank() == 0
    whole = {}
    for key, value in state.items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            whole[key] = value.cpu()
    return whole


@contextmanager
def gradient_sync_held(wrapped: nn.Module) -> Iterator[None]:
    """The backward inside communicates nothing: gradients accumulate on each rank until a later
    backward outside it (gradient accumulation's earlier micro-batches). DDP's `no_sync`, FSDP2's
    `set_requires_gradient_sync(False)`; one device has nothing to hold back."""
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        with wrapped.no_sync():
            yield
    elif sharded(wrapped):
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
    else:
        yield


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


# A worker that died of SIGABRT said nothing of its own: NCCL's watchdog takes a rank down so when a
# collective times out or fails (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, torch's default), past any
# Python handler, and leaves one C++ line in the rank's output.
ABORTED = (": SIGABRT, an abort in C++; on GPUs most often NCCL's watchdog ending a rank whose collective timed "
           "out or failed, because a rank stopped or died first or the ranks called collectives in different "
           "orders: its 'Watchdog caught collective operation timeout' line above names the collective")


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
        run_id=f"{gpus.RUN_ID_PREFIX}{uuid.uuid4().hex[:8]}",
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
        failures = ", ".join(f"rank {r} (exit code {f.exitcode}{ABORTED if f.exitcode == -signal.SIGABRT else ''})"
                             for r, f in sorted(exc.failures.items()))
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
