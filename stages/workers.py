"""For the stages that run one process per device: launching them, and describing where they ran."""

import os
import shutil
import subprocess
from pathlib import Path

import click
import torch

from pipeline import parallel, record
from pipeline.runtime import forkserver
from pipeline.config import Config
from pipeline.errors import PipelineError
from stages.common import WORKER_PRELOAD

SBATCH_SCRIPT = Path("deploy/slurm/train.sbatch")
WORKER_ENTRY = "stages.cli:run_worker_command"


def launch_workers(config: Config, command: list[str]) -> None:
    """Run `mnist-pipeline <command>` as one worker per device, as torchrun would."""
    nproc = config.train.nproc or parallel.default_nproc(config.train.device)
    forkserver.check_socket_path()
    if parallel.gpus_as_wanted(config.train.device) and (small := parallel.small_shm(nproc)):
        click.echo(f"{command[0]}: warning: {small}", err=True)  # NCCL's first collective would say less
    click.echo(f"{command[0]}: launching {nproc} workers")
    forkserver.start(WORKER_PRELOAD[command[0]])  # the CLI started it already, unless it could not tell it would launch
    with forkserver.workers_stopped_on_failure() as registry:
        # The workers run the CLI (stages.cli.run_worker_command), named rather than imported: the CLI
        # imports this stage's module, which imports this one.
        parallel.launch_workers(nproc, forkserver.run_named, [WORKER_ENTRY, str(registry), *command])


def gpu_request(config: Config) -> list[str]:
    """sbatch's GPU request: train.nproc GPUs per node with train.device: cuda. Without one, a
    cluster that confines devices with cgroups hides every GPU from the job, which would then train
    one CPU worker per node. (auto asks for none: the login node cannot see what the compute nodes
    hold, so say cuda to train on their GPUs.)"""
    if config.train.device != "cuda":
        return []
    if not config.train.nproc:
        raise PipelineError("train.device is cuda with train.launcher: slurm, so the job must ask Slurm for GPUs: "
                            "set train.nproc to the GPUs each node should give it (one worker per GPU)")
    return ["--gpus-per-node", str(config.train.nproc)]


def cpu_request(config: Config) -> list[str]:
    """sbatch's CPU request: train.cpus_per_rank for each worker of a node, all in the node's one
    task (it runs torchrun, which starts the workers). A GPU request alone gets the site's default
    CPUs, often one per job or per GPU, on which 8 workers would take turns."""
    return ["--cpus-per-task", str(config.train.cpus_per_rank * (config.train.nproc or 1))]


def slurm_ready() -> None:
    """sbatch and the batch script are here, and Slurm's controller answers (checked before a
    training changes anything)."""
    if shutil.which("sbatch") is None:
        raise PipelineError("train.launcher is slurm, but sbatch is not on PATH: run this on a Slurm login "
                            "node, or set train.launcher: local")
    if not SBATCH_SCRIPT.is_file():
        raise PipelineError(f"{SBATCH_SCRIPT}: missing; run from the project's root directory")
    if shutil.which("scontrol") is not None:  # from the same package as sbatch; a site may leave it out
        try:
            ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=SLURM_PING_TIMEOUT_S)
            answer, answered = (ping.stdout + ping.stderr).strip().splitlines()[:1], ping.returncode == 0
        except subprocess.TimeoutExpired:
            answer, answered = [f"no answer within {SLURM_PING_TIMEOUT_S} s"], False
        if not answered:
            raise PipelineError(
                f"train.launcher is slurm, but Slurm's controller does not answer (scontrol ping: "
                f"{answer[0] if answer else 'failed'}); start slurmctld or check SLURM_CONF "
                f"({os.environ.get('SLURM_CONF', 'unset')}), or set train.launcher: local")


SLURM_PING_TIMEOUT_S = 30  # scontrol's own message timeout is 10 s, and it tries a backup controller too


def submit_to_slurm(config: Config, command: list[str], log_dir: Path) -> None:
    """Run `mnist-pipeline <command>` as a Slurm job of train.nodes nodes and wait for it: the
    sbatch script starts one torchrun per node. The job writes into this directory, which the
    nodes share, so what it makes is here when sbatch returns."""
    slurm_ready()
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if config.train.nproc:
        env["NPROC_PER_NODE"] = str(config.train.nproc)
    output = log_dir / "slurm-%j.out"
    click.echo(f"{command[0]}: submitting to Slurm ({config.train.nodes} node(s)), waiting; log: {output}")
    sbatch = ["sbatch", "--wait", "--parsable", "--nodes", str(config.train.nodes), "--output", str(output),
              *gpu_request(config), *cpu_request(config), str(SBATCH_SCRIPT), *command]
    done = subprocess.run(sbatch, env=env, stdout=subprocess.PIPE, text=True)
    job = done.stdout.strip().split(";")[0]
    if done.returncode != 0:
        where = str(output).replace("%j", job) if job else str(log_dir)
        raise PipelineError(f"Slurm job {job or '(not submitted)'} failed (sbatch exit code {done.returncode}); "
                            f"see {where}")
    click.echo(f"{command[0]}: Slurm job {job} finished")


def run_facts(mode: str, rank: parallel.Rank, device: torch.device, distributed: bool) -> dict[str, str]:
    """The tags that say where and how a run ran."""
    return {
        "mode": mode,
        "world_size": str(rank.world_size),
        "backend": parallel.backend_for(device) if distributed else "none",
        "device_type": device.type,
        "device_name": parallel.device_name(device),
        **record.software(),
        **(record.gpus() if device.type == "cuda" else {}),
    }
