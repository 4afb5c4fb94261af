"""`mnist-pipeline sweep --on kubernetes`: each experiment of a sweep as a Kubeflow Trainer TrainJob
of its own (deploy/kubernetes/sweep-trainjob.yaml), its parameters in it at submission, never in
the image; kubectl applies them and reads their state back. Nothing waits for them here.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import yaml

from pipeline.errors import PipelineError

TEMPLATE = Path("deploy/kubernetes/sweep-trainjob.yaml")
LABEL = "mnist-pipeline/sweep"
TASK_ENV = "SWEEP_TASK"  # the experiment, as JSON, in its pod
KUBECTL_TIMEOUT_S = 120


def job_name(sweep_id: str, index: int) -> str:
    """A TrainJob's name: a DNS label (the sweep id is digits, '-' and hex)."""
    return f"mnist-sweep-{sweep_id}-{index + 1}"


SHM_MB = 8192  # the template's /dev/shm (a memory emptyDir), which counts against the memory limit


def check_configs(configs) -> None:
    """What a pod cannot find out for itself: it sees only the GPUs it asks for, and runs every
    stage where it is."""
    for config in configs:
        if config.train.device == "auto" or (config.train.device == "cuda" and not config.train.nproc):
            raise PipelineError("sweep --on kubernetes: a pod sees only the GPUs it asks for; set train.device: cuda "
                                "with train.nproc (the GPUs each experiment takes), or train.device: cpu")
        if config.train.launcher != "local":
            raise PipelineError(f"sweep --on kubernetes: train.launcher is {config.train.launcher}, but each "
                                "experiment runs every stage in its pod; set train.launcher: local")


def resources(configs) -> dict:
    """What each pod asks for, as Slurm's tasks do: the most CPUs (train.cpus_per_rank a worker),
    memory and GPUs (train.device: cuda, train.nproc of them) any experiment needs; the memory
    limit leaves room for /dev/shm."""
    cpus, megabytes, gpus = 0, 0, 0
    for config in configs:
        workers = config.train.nproc or 2  # 0: two DDP workers on a CPU (pipeline.parallel)
        cpus = max(cpus, config.train.cpus_per_rank * workers)
        megabytes = max(megabytes, round(config.train.mem_per_rank_gb * 1024 * workers))
        if config.train.device == "cuda":
            gpus = max(gpus, config.train.nproc)
    gpu = {"nvidia.com/gpu": gpus} if gpus else {}
    return {"requests": {"cpu": str(cpus), "memory": f"{megabytes}Mi", **gpu},
            "limits": {"memory": f"{megabytes + SHM_MB}Mi", **gpu}}


def manifests(record: dict, configs, template: str) -> list[dict]:
    """One TrainJob per experiment of `record`, from the template's text."""
    base = yaml.safe_load(template)
    jobs = []
    for experiment in record["experiments"]:
        job = copy.deepcopy(base)
        job["metadata"]["name"] = experiment["job"]
        job["metadata"]["labels"] = {LABEL: record["id"]}
        job["metadata"]["annotations"] = {"mnist-pipeline/experiment": experiment["name"]}
        task = {"id": record["id"], "commit": record["commit"], "url": record["url"],
                "experiments": [{"name": experiment["name"], "overrides": experiment["overrides"], "job": experiment["job"]}]}
        (entry,) = [e for e in job["spec"]["trainer"]["env"] if e["name"] == TASK_ENV]
        entry["value"] = json.dumps(task)
        job["spec"]["trainer"]["resourcesPerNode"] = resources(configs)
        if not configs or configs[0].train.device != "cuda":  # the image shows every GPU unless told not to
            job["spec"]["trainer"]["env"].append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"})
        jobs.append(job)
    return jobs


def write(folder: Path, jobs: list[dict]) -> Path:
    """Each TrainJob in a file of its own (a rerun applies one again), and all in trainjobs.yaml."""
    for job in jobs:
        (folder / f"{job['metadata']['name']}.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    every = folder / "trainjobs.yaml"
    every.write_text(yaml.safe_dump_all(jobs, sort_keys=False))
    return every


def check_kubectl() -> None:
    if shutil.which("kubectl") is None:
        raise PipelineError("sweep --on kubernetes: kubectl is not on PATH; install it and point it at the cluster "
                            "(KUBECONFIG), or add --manifests-only to write the TrainJobs for your own tooling")


def kubectl(*args: str) -> subprocess.CompletedProcess:
    check_kubectl()
    try:
        done = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PipelineError(f"sweep: kubectl {args[0]} did not answer within {KUBECTL_TIMEOUT_S} s; check the "
                            "cluster (kubectl cluster-info)") from None
    if done.returncode != 0:
        raise PipelineError(f"sweep: kubectl {' '.join(args[:2])} failed ({' '.join(done.stderr.split())[:300]})")
    return done


def state_of(job: dict | None) -> str:
    """A TrainJob's state from its conditions (Trainer's Suspended, Complete, Failed); one that is
    not there any more was deleted before it finished: failed."""
    if job is None:
        return "failed"
    conditions = {c.get("type"): c.get("status") for c in job.get("status", {}).get("conditions", [])}
    if conditions.get("Complete") == "True":
        return "done"
    if conditions.get("Failed") == "True" or conditions.get("Created") == "False":  # its JobSet could not be made
        return "failed"
    if conditions.get("Suspended") == "True":
        return "queued"
    return "running"


def jobs_of(record: dict) -> dict[str, dict]:
    listed = json.loads(kubectl("get", "trainjobs", "-l", f"{LABEL}={record['id']}", "-o", "json").stdout)
    found = {item["metadata"]["name"]: item for item in listed.get("items", [])}
    if not found:  # another namespace or cluster than the submission's, more likely than all deleted
        raise PipelineError(f"sweep {record['id']}: none of its TrainJobs is in kubectl's current namespace; switch "
                            "to the one it was submitted to (kubectl config set-context --current --namespace=NS)")
    return found


def submit(every: Path) -> None:
    """Apply every TrainJob, or none: the API server checks them all first (a schema or webhook
    refusal), and a failure halfway deletes those it made."""
    kubectl("apply", "--dry-run=server", "-f", str(every))
    try:
        kubectl("apply", "-f", str(every))
    except BaseException:
        subprocess.run(["kubectl", "delete", "--ignore-not-found", "--wait=false", "-f", str(every)],
                       capture_output=True, timeout=KUBECTL_TIMEOUT_S)
        raise


def apply_again(folder: Path, job: str) -> None:
    """A rerun: the old TrainJob and its JobSet gone first, then the same file applied."""
    kubectl("delete", "trainjob", job, "--ignore-not-found", "--cascade=foreground", "--wait")
    kubectl("apply", "-f", str(folder / f"{job}.yaml"))
