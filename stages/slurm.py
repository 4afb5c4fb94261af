"""With train.launcher: slurm, every stage that uses the device runs as a Slurm job, so that each mode
and the evaluation run on the same kind of node, and the speed-ups compare like with like: DDP and
commcheck as one torchrun a node (deploy/slurm/train.sbatch), single, dp and evaluate as one process
on one node (deploy/slurm/run.sbatch). `sbatch --wait`: the job writes into this directory, which
the nodes share, so what it makes is here when sbatch returns."""

import functools
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import click

from pipeline.config import Config, distributed
from pipeline.errors import PipelineError

DDP_SCRIPT = Path("deploy/slurm/train.sbatch")
ONE_PROCESS_SCRIPT = Path("deploy/slurm/run.sbatch")
# Set by run.sbatch for the command it runs: it runs here, in the job, not submitted again.
IN_JOB = "MNIST_PIPELINE_SLURM_JOB"
# Set by `submit` for the job: the command that submitted it holds models/<mode>'s lock and made
# every check before the job started (a job submitted by hand makes them itself).
SUBMITTED = "MNIST_PIPELINE_SUBMITTED"
CANCEL_TIMEOUT_S = 30
SLURM_PING_TIMEOUT_S = 30  # scontrol's own message timeout is 10 s, and it tries a backup controller too


@dataclass(frozen=True)
class Job:
    """What a job asks Slurm for. `devices`: a node's processes for DDP, the GPUs of the one
    process otherwise: with train.device: cuda, the GPUs asked for a node (None: train.nproc, unset)."""

    script: Path
    nodes: int
    devices: int | None


def job_for(config: Config, command: str, mode: str | None = None) -> Job:
    """DDP's (and commcheck's, which checks the link DDP will use) over train.nodes nodes with
    train.nproc workers each; DataParallel's over train.nproc GPUs of one node; one device else."""
    if command == "commcheck" or distributed(mode):
        return Job(DDP_SCRIPT, config.train.nodes, config.train.nproc or None)
    return Job(ONE_PROCESS_SCRIPT, 1, (config.train.nproc or None) if mode == "dp" else 1)


def in_job() -> bool:
    return bool(os.environ.get(IN_JOB))


def submitted_job() -> bool:
    """In a job `submit` made: the command is the submitter's, already checked and locked."""
    return in_job() and bool(os.environ.get(SUBMITTED))


def launcher(config: Config) -> str:
    """train.launcher, except in a job, which runs its command where it is."""
    return "local" if in_job() else config.train.launcher


@functools.cache
def partition_gpus() -> int | None:
    """The most GPUs a node of the job's partition holds, as Slurm's GRES say (sinfo): the partition
    SBATCH_PARTITION names (as sbatch reads it), else the default one. None where its nodes hold
    none, or sinfo cannot say. Asked once a command: the check before a stage and its submission."""
    try:
        listed = subprocess.run(["sinfo", "--noheader", "--format", "%P %G"], capture_output=True, text=True,
                                timeout=SLURM_PING_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    wanted = os.environ.get("SBATCH_PARTITION", "").split(",")[0]
    most = 0
    for line in listed.splitlines():
        name, _, gres = line.strip().partition(" ")
        if (name.rstrip("*") == wanted) if wanted else name.endswith("*"):
            for resource in gres.split(","):  # gpu:8, gpu:a100:8(S:0-1), shard:8 or (null)
                fields = resource.split("(")[0].split(":")
                if fields[0] == "gpu" and fields[-1].isdigit():
                    most = max(most, int(fields[-1]))
    return most or None


def gpus_asked(config: Config, job: Job) -> int | None:
    """The GPUs a node of the job asks for. train.device: cuda asks for them (train.nproc); auto
    asks wherever the partition's nodes hold GPUs, train.nproc of them or all a node holds, since a
    cluster that confines devices with cgroups shows a job none it did not ask for, and one that
    does not lets it take GPUs Slurm gave to other jobs. None: the CPU (cpu, or no GPU to ask for)."""
    if config.train.device == "cpu":
        return None
    if config.train.device == "auto":
        held = partition_gpus()
        return None if held is None else (job.devices or held)
    if job.devices is None:
        raise PipelineError("train.device is cuda with train.launcher: slurm, so the job must ask Slurm for GPUs: "
                            "set train.nproc to the GPUs each node should give it (one DDP worker per GPU; "
                            "DataParallel's GPUs)")
    return job.devices


def gpu_request(gpus: int | None) -> list[str]:
    return [] if gpus is None else ["--gpus-per-node", str(gpus)]


def cpu_request(config: Config, job: Job, gpus: int | None) -> list[str]:
    """sbatch's CPU request: train.cpus_per_rank for each device of a node, all in the node's one
    task (torchrun, which starts the workers, or the one process). A GPU request alone gets the
    site's default CPUs, often one per job or per GPU, on which 8 workers would take turns."""
    return ["--cpus-per-task", str(config.train.cpus_per_rank * (gpus or job.devices or 1))]


def memory_request(config: Config, job: Job, gpus: int | None) -> list[str]:
    """sbatch's memory request, per node: train.mem_per_rank_gb for each of its devices. Unasked,
    a job gets the site's DefMemPerCPU (or DefMemPerNode), which can be far too little for CUDA
    workers: the job is killed for memory with nothing wrong in the training."""
    megabytes = max(1, round(config.train.mem_per_rank_gb * 1024 * (gpus or job.devices or 1)))
    return ["--mem", f"{megabytes}M"]


def check_ready(config: Config, job: Job) -> None:
    """Everything about the submission that can fail, checked before a stage changes anything:
    sbatch and the batch script are here, the GPU request can be made, and Slurm's controller answers."""
    if shutil.which("sbatch") is None:
        raise PipelineError("train.launcher is slurm, but sbatch is not on PATH: run this on a Slurm login "
                            "node, or set train.launcher: local")
    if not job.script.is_file():
        raise PipelineError(f"{job.script}: missing; run from the project's root directory")
    gpus_asked(config, job)
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


def submit(config: Config, command: list[str], log_dir: Path, job: Job) -> None:
    """Run `mnist-pipeline <command>` as `job` and wait for it; its output goes to log_dir. The job
    never outlives the command: interrupted (Ctrl-C, a stop signal, DVC's), it cancels the job
    before it lets go of what the job writes to."""
    check_ready(config, job)
    gpus = gpus_asked(config, job)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, SUBMITTED: "1"}
    if job.script == DDP_SCRIPT and config.train.nproc:
        env["NPROC_PER_NODE"] = str(config.train.nproc)
    # A name of its own: the job can be cancelled by it before sbatch has said its id.
    name = f"mnist-{command[0]}-{command[2] if command[1:2] == ['--mode'] else 'all'}-{secrets.token_hex(4)}"
    output = log_dir / "slurm-%j.out"
    click.echo(f"{command[0]}: submitting to Slurm ({job.nodes} node(s)), waiting; log: {output}")
    sbatch = ["sbatch", "--wait", "--parsable", "--job-name", name, "--nodes", str(job.nodes), "--output", str(output),
              *gpu_request(gpus), *cpu_request(config, job, gpus), *memory_request(config, job, gpus), str(job.script), *command]
    with subprocess.Popen(sbatch, env=env, stdout=subprocess.PIPE, text=True) as sbatch_process:
        try:
            job_id = sbatch_process.stdout.readline().strip().split(";")[0]  # said at submission
            returncode = sbatch_process.wait()
        except BaseException:
            cancel(name)
            raise
    if returncode != 0:
        log = Path(str(output).replace("%j", job_id)) if job_id else None
        raise PipelineError(f"Slurm job {job_id or '(not submitted)'} failed (sbatch exit code {returncode})"
                            + (f"; its last words: {last_words(log)}; see {log}" if log and log.is_file()
                               else f"; see {log or log_dir}"))
    click.echo(f"{command[0]}: Slurm job {job_id} finished")


def cancel(name: str) -> None:
    """Cancel the job by its name: the command that waited for it is going, and a job left running
    would write into models/ under the next training."""
    try:
        subprocess.run(["scancel", "--name", name], capture_output=True, timeout=CANCEL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        click.echo(f"warning: could not cancel Slurm job {name} ({exc}): `scancel --name {name}`", err=True)


def last_words(log: Path, lines: int = 2) -> str:
    """The job log's last lines (the error of a command that failed in it), as one line."""
    said = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(said[-lines:]) or "(nothing)"
