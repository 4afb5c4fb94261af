"""The files users submit to a cluster as they are: the Kubeflow TrainJob against the real CRD
schema, and the Slurm batch script. (Both also run for real: tests/test_multinode.py.)"""

from __future__ import annotations

import copy
import subprocess

import jsonschema
import pytest
import yaml

from tests.conftest import ROOT

TRAINJOB = ROOT / "deploy/kubernetes/trainjob.yaml"
REFERENCE = ROOT.parent / "shared/reference/kubeflow-trainer"


def strict(schema):
    """The CRD's OpenAPI schema as JSON Schema, stricter than the API server: the server prunes
    fields it does not know without a word, so a misspelt field would silently do nothing; here
    it is an error. Kubernetes' int-or-string becomes what it means."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def trainjob_schema() -> dict:
    crd = yaml.safe_load((REFERENCE / "trainer.kubeflow.org_trainjobs.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return strict(version["schema"]["openAPIV3Schema"])


def manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(TRAINJOB.read_text())}


def test_the_trainjob_is_valid_against_kubeflow_trainers_crd():
    job = manifests()["TrainJob"]
    jsonschema.validate(job, trainjob_schema())
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"


def test_the_schema_check_catches_a_misspelt_field():
    job = copy.deepcopy(manifests()["TrainJob"])
    job["spec"]["trainer"]["numNode"] = job["spec"]["trainer"].pop("numNodes")
    with pytest.raises(jsonschema.ValidationError, match="numNode"):
        jsonschema.validate(job, trainjob_schema())


def test_the_trainjob_runs_torchrun_on_the_runtime_it_names_with_what_nccl_and_outputs_need():
    docs = manifests()
    job, runtime = docs["TrainJob"], yaml.safe_load((REFERENCE / "torch_distributed.yaml").read_text())
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"] == "torch-distributed"
    shell, flags, script = job["spec"]["trainer"]["command"]
    assert (shell, flags) == ("sh", "-ec")
    # torchrun, as the last command of the script (it reads the PET_* variables Trainer injects),
    # after the rendezvous check (tests/test_rendezvous.py runs both).
    *checks, last = script.strip().splitlines()
    assert last.startswith("exec torchrun ") and any("rendezvous-check" in line for line in checks)
    (patched,) = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    runtime_jobs = [j["name"] for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]]
    assert patched["name"] in runtime_jobs
    pod = patched["template"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claim = volumes[mounts["/workspace/models"]]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert "ReadWriteMany" in docs["PersistentVolumeClaim"]["spec"]["accessModes"]
    assert {"/workspace/data/prepared", "/workspace/models", "/workspace/results", "/workspace/plots"} <= set(mounts)
    (uri,) = [e for e in job["spec"]["trainer"]["env"] if e["name"] == "MLFLOW_TRACKING_URI"]
    assert "value" not in uri and uri["valueFrom"]["configMapKeyRef"]["key"] == "MLFLOW_TRACKING_URI"
    # Every credential comes from a Secret, never from this file.
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        (secret,) = [e for e in job["spec"]["trainer"]["env"] if e["name"] == name]
        assert "value" not in secret and secret["valueFrom"]["secretKeyRef"]["name"], name
    assert "WORKDIR /workspace\n" in (ROOT / "Dockerfile").read_text()  # where the mounts land


@pytest.mark.parametrize("script", ["train.sbatch", "run.sbatch"])
def test_the_sbatch_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(ROOT / "deploy/slurm" / script)], check=True)


# Pod Security Standards, "restricted" profile (kubernetes.io/docs/concepts/security/pod-security-standards):
# the volume types it allows, and the capabilities a container may add back after dropping ALL.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    """What keeps `pod` (a pod spec) out of a namespace that enforces Pod Security "restricted"."""
    bad = []
    pod_ctx = pod.get("securityContext", {})
    for volume in pod.get("volumes", []):
        if not set(volume) - {"name"} <= RESTRICTED_VOLUMES:
            bad.append(f"volume {volume['name']}: type {sorted(set(volume) - {'name'})} not allowed")
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        bad.append("host namespaces")
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        ctx, name = container.get("securityContext", {}), container["name"]
        if ctx.get("privileged"):
            bad.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation", True) is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        if "ALL" not in ctx.get("capabilities", {}).get("drop", []):
            bad.append(f"{name}: capabilities must drop ALL")
        if set(ctx.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities")
        if not (ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True):
            bad.append(f"{name}: runAsNonRoot must be true")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            bad.append(f"{name}: runs as uid 0")
        seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                bad.append(f"{name}: hostPort")
    return bad


def patched_pod(job: dict) -> dict:
    (patched,) = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return patched["template"]["spec"]["template"]["spec"]


def test_the_trainjob_meets_pod_security_restricted_with_limits_and_a_versioned_image():
    job = manifests()["TrainJob"]
    assert restricted_violations(patched_pod(job)) == []
    resources = job["spec"]["trainer"]["resourcesPerNode"]
    for kind in ("cpu", "memory"):
        assert kind in resources["requests"] and kind in resources["limits"], kind
    image = job["spec"]["trainer"]["image"]
    tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
    assert tag and tag != "latest", image
    assert "uid/gid 1000" in TRAINJOB.read_text()  # the uid it runs as is the image's user (Dockerfile)
    assert "useradd --create-home --uid 1000" in (ROOT / "Dockerfile").read_text()


def test_the_trainjob_asks_for_the_cpus_of_its_workers_as_the_slurm_job_does():
    """train.cpus_per_rank for each worker a node, the same request `sbatch --cpus-per-task` makes."""
    trainer = manifests()["TrainJob"]["spec"]["trainer"]
    per_rank = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["cpus_per_rank"]
    requested = int(trainer["resourcesPerNode"]["requests"]["cpu"])
    assert requested == per_rank * trainer["numProcPerNode"]
    assert int(trainer["resourcesPerNode"]["limits"]["cpu"]) >= requested


def test_the_restricted_check_catches_what_the_profile_forbids():
    pod = copy.deepcopy(patched_pod(manifests()["TrainJob"]))
    pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    pod["securityContext"].pop("seccompProfile")
    pod["containers"][0]["securityContext"].pop("seccompProfile")
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert len(restricted_violations(pod)) == 3
