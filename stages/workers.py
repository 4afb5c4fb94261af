"""For the stages that run one process per device: launching them, and describing where they ran."""

import sys

import click
import torch

from pipeline import parallel
from pipeline.config import Config


def launch_workers(config: Config, command: list[str]) -> None:
    """Run `mnist-pipeline <command>` as one worker per device, as torchrun would."""
    nproc = config.train.nproc or parallel.default_nproc()
    click.echo(f"{command[0]}: launching {nproc} workers")
    parallel.launch_workers(nproc, [sys.executable, "-m", "pipeline", *command])


def run_facts(mode: str, rank: parallel.Rank, device: torch.device, distributed: bool) -> dict[str, str]:
    """The tags that say where and how a run ran."""
    return {
        "mode": mode,
        "world_size": str(rank.world_size),
        "backend": parallel.backend_for(device) if distributed else "none",
        "device_type": device.type,
        "device_name": parallel.device_name(device),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "none",
    }
