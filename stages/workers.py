"""For the stages that run one process per device: launching them here, and describing where they ran
(stages/slurm.py submits them to a cluster)."""

import click
import torch

from pipeline import gpus, parallel, record
from pipeline.runtime import forkserver
from pipeline.config import Config
from stages.common import WORKER_PRELOAD

WORKER_ENTRY = "stages.cli:run_worker_command"


def launch_workers(config: Config, command: list[str]) -> None:
    """Run `mnist-pipeline <command>` as one worker per device, as torchrun would."""
    nproc = config.train.nproc or parallel.default_nproc(config.train.device)
    forkserver.check_socket_path()
    if gpus.gpus_as_wanted(config.train.device) and (small := parallel.small_shm(nproc)):
        click.echo(f"{command[0]}: warning: {small}", err=True)  # NCCL's first collective would say less
    click.echo(f"{command[0]}: launching {nproc} workers")
    forkserver.start(WORKER_PRELOAD[command[0]])  # the CLI started it already, unless it could not tell it would launch
    with forkserver.workers_stopped_on_failure() as registry:
        # The workers run the CLI (stages.cli.run_worker_command), named rather than imported: the CLI
        # imports this stage's module, which imports this one.
        parallel.launch_workers(nproc, forkserver.run_named, [WORKER_ENTRY, str(registry), *command])


def cpu_facts() -> dict[str, str]:
    """On the CPU, how the work was split: the threads (OMP_NUM_THREADS, or DDP's share of the
    cores) and the cores this process may use (taskset, cpusets, a cgroup quota). Both change how
    a sum is split, so the floats' last bits."""
    return {"cpu_threads": str(torch.get_num_threads()), "usable_cpus": str(parallel.available_cpus())}


def run_facts(mode: str, rank: parallel.Rank, device: torch.device, distributed: bool) -> dict[str, str]:
    """The tags that say where and how a run ran."""
    return {
        "mode": mode,
        "world_size": str(rank.world_size),
        "backend": parallel.backend_for(device) if distributed else "none",
        "device_type": device.type,
        "device_name": parallel.device_name(device),
        **record.software(),
        **(record.gpus() if device.type == "cuda" else cpu_facts()),
    }
