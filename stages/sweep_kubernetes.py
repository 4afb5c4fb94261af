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


def resources(configs) -> dict:
    """What each pod asks for, as Slurm's tasks do: the most CPUs (train.cpus_per_rank a device),
    memory and GPUs (train.device: cuda, train.nproc of them) any experiment needs."""
    cpus, megabytes, gpus = 0, 0, 0
    for config in configs:
        devices = max(config.train.nproc, 1)
        cpus = max(cpus, config.train.cpus_per_rank * devices)
        megabytes = max(megabytes, round(config.train.mem_per_rank_gb * 1024 * devices))
        if config.train.device == "cuda":
            gpus = max(gpus, devices)
    asked = {"cpu": str(cpus), "memory": f"{megabytes}Mi", **({"nvidia.com/gpu": gpus} if gpus else {})}
    return {"requests": asked, "limits": {key: value for key, value in asked.items() if key != "cpu"}}


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
    if conditions.get("Failed") == "True":
        return "failed"
    if conditions.get("Suspended") == "True":
        return "queued"
    return "running"


def jobs_of(record: dict) -> dict[str, dict]:
    listed = json.loads(kubectl("get", "trainjobs", "-l", f"{LABEL}={record['id']}", "-o", "json").stdout)
    return {item["metadata"]["name"]: item for item in listed.get("items", [])}
