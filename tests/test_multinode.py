"""DDP across two hosts, for real: two network namespaces stand in for two machines (tests/hosts.py),
each with its own working directory, as nodes have their own disks. Every rank logs to one real
`mlflow server` (PostgreSQL backend, proxied artifacts) running on node-a. Then the same training
under a real Slurm cluster (slurmctld + one slurmd per host), submitted by `dvc repro`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import (
    ROOT,
    SERVER_ENV,
    SMALL,
    TABLE,
    add_table_workload,
    load_weights,
    make_project,
    max_abs_diff,
    prepare,
    project_env,
    relative_difference,
    subprocess_env,
    train_cli,
)
from tests.hosts import INTERFACE, TwoHosts, skip_reason, wait_until

pytestmark = [pytest.mark.multinode,
              pytest.mark.skipif(skip_reason() is not None, reason=f"multinode: {skip_reason()}")]

PARENT = "mlflow.parentRunId"
SERVER_PORT = 5000
RDZV_PORT = 29400
TWO_NODE_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def hosts():
    with TwoHosts() as pair:
        yield pair


def pg_bin(name: str) -> str:
    """A PostgreSQL program: on PATH, or where Debian's postgresql package puts it."""
    found = shutil.which(name) or next(iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))), None)
    if found is None:
        pytest.fail(f"PostgreSQL's {name} is missing; `make test` installs it (scripts/test-deps.sh)")
    return str(found)


def _as_postgres(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True, capture_output=True,
                          text=True, **kwargs)


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server of the test's own, reached through a Unix socket in its folder (every
    namespace sees the file system, so both hosts' processes can reach it). Yields the folder."""
    home = Path(tempfile.mkdtemp(prefix="mnp-pg-"))
    shutil.chown(home, "postgres", "postgres")  # postgres refuses to run as root
    _as_postgres(pg_bin("initdb"), "--auth=trust", "--username=postgres", "-D", str(home / "data"))
    server = subprocess.Popen(["runuser", "-u", "postgres", "--", pg_bin("postgres"), "-D", str(home / "data"), "-k",
                               str(home), "-c", "listen_addresses="], stdout=subprocess.DEVNULL,
                              stderr=open(home / "postgres.log", "w"))  # noqa: SIM115 (lives with the server)
    try:
        wait_until(lambda: (home / ".s.PGSQL.5432").exists(), "PostgreSQL socket", timeout=60,
                   diagnose=lambda: (home / "postgres.log").read_text())
        _as_postgres(pg_bin("psql"), "-h", str(home), "-U", "postgres", "-c", "CREATE DATABASE mlflow")
        yield home
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)


# The server's account, as every rank gets it: from the environment, never inside the URI.
CREDENTIALS = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": f"pw-{uuid.uuid4().hex}"}


@pytest.fixture(scope="module")
def tracking_server(hosts, postgres, tmp_path_factory):
    """`mlflow server` on node-a as the README starts it, every node's ranks log to it: PostgreSQL
    for runs and metrics, artifacts proxied through the server into its own folder, MLflow's
    basic-auth app, and reached by host name (which --allowed-hosts must name)."""
    node_a = hosts[0]
    home = tmp_path_factory.mktemp("mlflow-server")
    (home / "basic_auth.ini").write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{home / 'basic_auth.db'}\nadmin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "auth_cache_ttl_seconds = 60\n")
    server_env = subprocess_env(**SERVER_ENV, MLFLOW_AUTH_CONFIG_PATH=str(home / "basic_auth.ini"),
                                MLFLOW_AUTH_ADMIN_PASSWORD=CREDENTIALS["MLFLOW_TRACKING_PASSWORD"],
                                MLFLOW_FLASK_SERVER_SECRET_KEY=uuid.uuid4().hex)
    server = node_a.popen(
        ["mlflow", "server", "--app-name", "basic-auth", "--host", "0.0.0.0", "--port", str(SERVER_PORT),
         "--allowed-hosts", f"{node_a.name}:{SERVER_PORT},{node_a.name}", "--workers", "1",
         "--backend-store-uri", f"postgresql+psycopg://postgres@/mlflow?host={postgres}",
         "--artifacts-destination", str(home / "artifacts")],
        cwd=home, env=server_env, log=home / "server.log")
    uri = f"http://{node_a.name}:{SERVER_PORT}"
    try:
        wait_until(lambda: _answers(node_a, uri), "mlflow server on node-a", timeout=180, interval=2,
                   diagnose=lambda: (home / "server.log").read_text()[-3000:])
        yield uri
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def _answers(host, uri: str) -> bool:
    probe = f"import urllib.request; urllib.request.urlopen('{uri}/health', timeout=2)"
    return host.run(["python", "-c", probe], cwd=Path("/"), env=subprocess_env(), timeout=30).returncode == 0


def server_runs(host, uri: str) -> list[dict]:
    """Every run of the pipeline's experiment as the server has it (asked from node-a)."""
    code = (
        "import json, mlflow\n"
        f"client = mlflow.MlflowClient('{uri}')\n"
        "exp = client.get_experiment_by_name('mnist-data-parallel')\n"
        "runs = client.search_runs([exp.experiment_id], max_results=500)\n"
        "print(json.dumps([{'id': r.info.run_id, 'name': r.info.run_name, 'status': r.info.status,\n"
        "  'tags': r.data.tags, 'metrics': sorted(r.data.metrics),\n"
        "  'artifacts': [a.path for a in client.list_artifacts(r.info.run_id)]} for r in runs]))\n")
    proc = host.run(["python", "-c", code], cwd=Path("/"), env=subprocess_env(**CREDENTIALS), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def node_dirs(project: Path, root: Path) -> list[Path]:
    """One working directory per node, each with its own copy of the code and the prepared data."""
    dirs = []
    for name in ("node-a", "node-b"):
        dirs.append(shutil.copytree(project, root / name, ignore=shutil.ignore_patterns(
            "models", "mlflow.db*", "mlartifacts", "metrics", "results", "plots")))
    return dirs


def train_on_two_hosts(hosts, dirs: list[Path], uri: str, logs: Path, mode: str = "ddp", nproc: int = 1,
                       **env: str) -> list[str]:
    """One torchrun agent per host, `nproc` workers each, as a user would start them by hand (README,
    "Beyond one machine"); returns each host's output."""
    job = uuid.uuid4().hex[:8]
    procs = []
    for host, folder in zip(hosts, dirs):
        is_host = int(host is hosts[0])
        argv = ["torchrun", "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{hosts[0].address}:{RDZV_PORT}", "--rdzv-id", job,
                "--rdzv-conf", f"is_host={is_host}", "--local-addr", host.address, "--max-restarts", "1",
                "-m", "stages", "train", "--mode", mode]
        procs.append(host.popen(argv, cwd=folder, log=logs / f"{host.name}.log", env=subprocess_env(
            **project_env(folder, GLOO_SOCKET_IFNAME=INTERFACE, MLFLOW_TRACKING_URI=uri, **CREDENTIALS, **env))))
    outputs = []
    for host, proc in zip(hosts, procs):
        try:
            proc.wait(timeout=TWO_NODE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in procs:
                os.killpg(other.pid, 9)
        outputs.append((logs / f"{host.name}.log").read_text())
    for host, proc, out in zip(hosts, procs, outputs):
        assert proc.returncode == 0, f"{host.name} exited {proc.returncode}:\n{out[-6000:]}"
    return outputs


def rank0_dir(dirs: list[Path], mode: str = "ddp") -> Path:
    """The node whose disk holds the outputs: wherever rank 0 ran."""
    (found,) = [d for d in dirs if (d / "models" / mode / "model.pt").is_file()]
    return found


@pytest.fixture(scope="module")
def uninterrupted(hosts, tracking_server, small_project, tmp_path_factory):
    root = tmp_path_factory.mktemp("two-hosts")
    dirs = node_dirs(small_project, root)
    outputs = train_on_two_hosts(hosts, dirs, tracking_server, root)
    return dirs, outputs


def test_ddp_on_two_hosts_matches_single_and_logs_every_rank_to_one_server(hosts, tracking_server,
                                                                           uninterrupted, small_project):
    dirs, outputs = uninterrupted
    train_cli(small_project, "single")
    main = rank0_dir(dirs)
    assert relative_difference(load_weights(small_project, "single"), load_weights(main, "ddp")) < 1e-3

    summary = json.loads((main / "results/train/ddp.json").read_text())
    assert (summary["world_size"], summary["nodes"], summary["procs_per_node"]) == (2, 2, 1)
    for folder in dirs:  # the server has it all: no node made a store of its own
        assert not (folder / "mlflow.db").exists() and not (folder / "mlartifacts").exists()

    runs = server_runs(hosts[0], tracking_server)
    (parent,) = [r for r in runs if r["name"] == "ddp" and PARENT not in r["tags"]]
    children = [r for r in runs if r["tags"].get(PARENT) == parent["id"]]
    assert parent["status"] == "FINISHED" and [c["status"] for c in children] == ["FINISHED"] * 2
    assert {c["tags"]["host"] for c in children} == {"node-a", "node-b"}
    assert {c["tags"]["rank"] for c in children} == {"0", "1"}
    for child in children:  # each rank's log, uploaded through the server from its own host
        assert f"rank-{child['tags']['rank']}.log" in child["artifacts"]
    # One system-metrics monitor per node, each under its host name.
    nodes = {key.split("/")[1] for key in parent["metrics"] if key.startswith("system/")}
    assert nodes == {"node-a", "node-b"}
    assert {"val_accuracy", "samples_per_s"} <= set(parent["metrics"])


def test_hybrid_fsdp_on_two_hosts_shards_within_each_and_replicates_across(hosts, tracking_server, uninterrupted,
                                                                           small_project, tmp_path):
    """train.fsdp_sharding: hybrid over 2 hosts of 2 workers: a 2-D mesh, each host's pair sharding
    the model between them and the two hosts replicas of each other. It trains what one device
    trains; each rank holds half of what each ddp rank holds whole; every rank has its run."""
    dirs = node_dirs(small_project, tmp_path)
    for folder in dirs:
        params = folder / "params.yaml"
        raw = yaml.safe_load(params.read_text())
        raw["train"]["fsdp_sharding"] = "hybrid"
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
    train_on_two_hosts(hosts, dirs, tracking_server, tmp_path, mode="fsdp", nproc=2)
    main = rank0_dir(dirs, "fsdp")
    if not (small_project / "models/single/model.pt").is_file():
        train_cli(small_project, "single")
    assert relative_difference(load_weights(small_project, "single"), load_weights(main, "fsdp")) < 1e-3
    summary = json.loads((main / "results/train/fsdp.json").read_text())
    assert (summary["world_size"], summary["nodes"], summary["procs_per_node"]) == (4, 2, 2)
    ddp = json.loads((rank0_dir(uninterrupted[0]) / "results/train/ddp.json").read_text())
    assert 0.45 * ddp["state_mb_per_rank"] < summary["state_mb_per_rank"] <= 0.55 * ddp["state_mb_per_rank"]
    runs = server_runs(hosts[0], tracking_server)
    (parent,) = [r for r in runs if r["name"] == "fsdp" and PARENT not in r["tags"]]
    children = [r for r in runs if r["tags"].get(PARENT) == parent["id"]]
    assert parent["status"] == "FINISHED" and sorted(c["tags"]["rank"] for c in children) == ["0", "1", "2", "3"]
    assert {c["tags"]["host"] for c in children} == {"node-a", "node-b"}


def test_a_crash_with_node_local_disks_resumes_to_the_uninterrupted_weights(hosts, tracking_server, uninterrupted,
                                                                           small_project, tmp_path):
    """Every worker dies after epoch 1; torchrun restarts them. Only rank 0's node holds the
    checkpoint, so the other node must get the state from it, not start over."""
    reference = load_weights(rank0_dir(uninterrupted[0]), "ddp")
    dirs = node_dirs(small_project, tmp_path)
    outputs = train_on_two_hosts(hosts, dirs, tracking_server, tmp_path, MNIST_PIPELINE_CRASH_AFTER_EPOCH="1")
    both = "".join(outputs)
    assert "crashing after epoch 1" in both
    # Epoch 1 ran once, before the crash; after the restart every rank went on with epoch 2.
    assert both.count("ddp epoch 1/2") == 1 and both.count("ddp epoch 2/2") == 1, both[-4000:]
    assert max_abs_diff(reference, load_weights(rank0_dir(dirs), "ddp")) == 0.0
    checkpoints = [d for d in dirs if (d / "models/ddp/checkpoint.pt").is_file()]
    assert checkpoints == [rank0_dir(dirs)] or len(checkpoints) == 2  # rank 0 may move on a restart


def test_the_server_refuses_a_client_without_the_account_before_training(hosts, tracking_server, small_project):
    """Anyone who reaches the server must not log to it: without credentials, the training stops
    before it starts, saying which variables to set."""
    proc = hosts[0].run(["mnist-pipeline", "train", "--mode", "single"], cwd=small_project, timeout=300,
                        env=subprocess_env(**project_env(small_project, MLFLOW_TRACKING_URI=tracking_server)))
    assert proc.returncode == 1 and "refused this client (HTTP 401" in proc.stderr, proc.stderr[-3000:]
    assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in proc.stderr and "Traceback" not in proc.stderr
    wrong = {**CREDENTIALS, "MLFLOW_TRACKING_PASSWORD": "guess"}
    proc = hosts[0].run(["mnist-pipeline", "train", "--mode", "single"], cwd=small_project, timeout=300,
                        env=subprocess_env(**project_env(small_project, MLFLOW_TRACKING_URI=tracking_server, **wrong)))
    assert proc.returncode == 1 and "refused this client (HTTP 401" in proc.stderr, proc.stderr[-3000:]
    assert "guess" not in proc.stderr


def test_a_store_on_a_nodes_disk_is_refused_before_training(hosts, small_project, tmp_path):
    dirs = node_dirs(small_project, tmp_path)
    job = uuid.uuid4().hex[:8]
    procs = [host.popen(["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"{hosts[0].address}:{RDZV_PORT}", "--rdzv-id", job,
                         "--rdzv-conf", f"is_host={int(host is hosts[0])}", "--local-addr", host.address,
                         "-m", "stages", "train", "--mode", "ddp"],
                        cwd=folder, log=tmp_path / f"{host.name}.log",
                        env=subprocess_env(**project_env(folder, GLOO_SOCKET_IFNAME=INTERFACE)))
             for host, folder in zip(hosts, dirs)]
    for proc in procs:
        proc.wait(timeout=TWO_NODE_TIMEOUT_S)
    refusal = "the ranks run on 2 nodes, but the tracking store is sqlite:///"
    for host, proc, folder in zip(hosts, procs, dirs):
        out = (tmp_path / f"{host.name}.log").read_text()
        assert proc.returncode != 0 and "epoch 1/2" not in out, out[-3000:]
        assert not (folder / "mlflow.db").exists()
        if host is hosts[0]:  # the rendezvous host's agent outlives the others: its worker always says why
            assert refusal in out and "MLFLOW_TRACKING_URI" in out, out[-3000:]
        else:  # its worker says why, unless the host's agent left first and took the store down with it
            assert refusal in out or "The connection to the C10d store has failed" in out, out[-3000:]


def test_the_kubeflow_trainjob_command_under_the_environment_trainer_injects(hosts, tracking_server,
                                                                            uninterrupted, small_project, tmp_path):
    """Each host plays one pod of deploy/kubernetes/trainjob.yaml: its container command, its env,
    and the PET_* variables the torch-distributed runtime injects (no other rendezvous flags)."""
    import yaml

    job = next(d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/trainjob.yaml").read_text())
               if d["kind"] == "TrainJob")
    trainer = job["spec"]["trainer"]
    # What Kubernetes resolves: a literal value, or the ConfigMap entry (here, the test's server).
    config_map = {"MLFLOW_TRACKING_URI": tracking_server}
    secrets = {"mlflow-credentials": {"username": CREDENTIALS["MLFLOW_TRACKING_USERNAME"],
                                      "password": CREDENTIALS["MLFLOW_TRACKING_PASSWORD"]}}

    def resolve(entry: dict) -> str | None:
        """As the kubelet does: None for an optional key that is not there (the variable stays unset)."""
        if "value" in entry:
            return entry["value"]
        if "configMapKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["configMapKeyRef"]
            found = config_map.get(ref["key"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            found = secrets.get(ref["name"], {}).get(ref["key"])
        assert found is not None or ref.get("optional"), f"{entry['name']}: {ref} is not optional"
        return found

    manifest_env = {e["name"]: value for e in trainer["env"] if (value := resolve(e)) is not None}
    assert {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} <= set(manifest_env)
    dirs = node_dirs(small_project, tmp_path)
    procs = []
    for node_rank, (host, folder) in enumerate(zip(hosts, dirs)):
        injected = {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                    "PET_NODE_RANK": str(node_rank), "PET_MASTER_ADDR": hosts[0].address,
                    "PET_MASTER_PORT": str(RDZV_PORT)}
        procs.append(host.popen(trainer["command"], cwd=folder, log=tmp_path / f"{host.name}.log",
                                env=subprocess_env(**project_env(folder, **manifest_env, **injected))))
    for proc in procs:
        proc.wait(timeout=TWO_NODE_TIMEOUT_S)
    for host, proc in zip(hosts, procs):
        assert proc.returncode == 0, (tmp_path / f"{host.name}.log").read_text()[-5000:]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 1
    assert max_abs_diff(load_weights(rank0_dir(uninterrupted[0]), "ddp"), load_weights(rank0_dir(dirs), "ddp")) == 0.0


# --- Slurm -------------------------------------------------------------------------------------------

SLURM_CONF = """\
ClusterName=mnist
SlurmctldHost=node-a({a})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits out a step credential's lifetime before it starts again (slurm.conf(5),
# cred_expire: 120 s by default); 30 s still leaves a slow day's step launch its credential.
AuthInfo=socket={munge_socket},cred_expire=30
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# `sbatch --wait` polls at 2 s, then 8 and 32 s, unless a finished job could leave the controller
# between polls (after MinJobAge, 300 s by default): at 5 s it polls every 2 s, as a job's end is
# seen at once (src/sbatch/sbatch.c, _job_wait). Nothing here reads a job once it ended.
MinJobAge=5
StateSaveLocation={home}/state
SlurmdSpoolDir={home}/spool-%n
SlurmctldPidFile={home}/slurmctld.pid
SlurmdPidFile={home}/slurmd-%n.pid
SlurmctldLogFile={home}/slurmctld.log
SlurmdLogFile={home}/slurmd-%n.log
GresTypes=gpu
NodeName=node-a NodeAddr={a} CPUs=2 RealMemory=2000 Gres=gpu:2 State=UNKNOWN
NodeName=node-b NodeAddr={b} CPUs=2 RealMemory=2000 Gres=gpu:2 State=UNKNOWN
PartitionName=main Nodes=node-a,node-b Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm(hosts):
    """A real Slurm cluster over the two hosts: munged, slurmctld on node-a, one slurmd per host.
    Yields the environment that points Slurm's commands at it."""
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.fail("slurm-wlm and munge are missing; `make test` installs them (scripts/test-deps.sh)")
    home = Path(tempfile.mkdtemp(prefix="mnp-slurm-"))
    (home / "state").mkdir()
    key, socket_path = home / "munge.key", home / "munge.socket"
    subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
    munged = subprocess.Popen(["munged", "--foreground", "--key-file", str(key), "--socket", str(socket_path),
                               "--pid-file", str(home / "munged.pid"), "--log-file", str(home / "munged.log"),
                               "--seed-file", str(home / "munged.seed"), "--force"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    conf = home / "slurm.conf"
    conf.write_text(SLURM_CONF.format(a=hosts[0].address, b=hosts[1].address, home=home, munge_socket=socket_path))
    # Two GPUs a node, declared rather than detected (these hosts have none): Slurm grants them to a
    # job that asks, as a GPU cluster would, so what a job asks for shows in what it gets. Slurm
    # counts a GPU by its device file; these stand in for /dev/nvidia0 and 1 (null devices).
    for index in range(2):
        os.mknod(home / f"nvidia{index}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (home / "gres.conf").write_text(f"AutoDetect=off\nNodeName=node-a,node-b Name=gpu File={home}/nvidia[0-1]\n")
    env = subprocess_env(SLURM_CONF=str(conf))
    daemons = []
    try:
        wait_until(socket_path.exists, "munged socket", timeout=30)
        daemons.append(hosts[0].popen(["slurmctld", "-D", "-c", "-f", str(conf)], cwd=home, env=env,
                                      log=home / "slurmctld.out"))
        for host in hosts:
            daemons.append(host.popen(["slurmd", "-D", "-N", host.name, "-f", str(conf)], cwd=home, env=env,
                                      log=home / f"slurmd-{host.name}.out"))

        def idle() -> bool:
            out = hosts[0].run(["sinfo", "-h", "-N", "-o", "%N %t"], cwd=home, env=env, timeout=30).stdout
            return sorted(out.split()) == sorted(["node-a", "idle", "node-b", "idle"])

        wait_until(idle, "both slurmd idle", timeout=90, interval=1,
                   diagnose=lambda: "\n".join(p.read_text()[-2000:] for p in sorted(home.glob("*.log"))))
        yield env
    finally:
        for daemon in daemons:
            os.killpg(daemon.pid, 9)
        munged.terminate()
        munged.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)


def test_with_slurm_single_dp_and_evaluate_run_in_jobs_too(hosts, slurm, tracking_server, mnist_dir, tmp_path):
    """train.launcher: slurm sends every stage that uses the device to the cluster, not only DDP, so
    that the speed-ups compare one kind of node: single and dp train in one-process jobs, and
    evaluate tests them in a third; the login node runs only `dvc repro` (and prepare, compare).
    The workload is a team's own (examples/workloads/table.py in the project's workloads/): the
    jobs build it from the project, as they build MNIST."""
    project = make_project(tmp_path / "proj", {**SMALL, "workload": TABLE,
                                               "train": {**SMALL["train"], "launcher": "slurm",
                                                         "modes": ["single", "dp"], "nodes": 1, "nproc": 1,
                                                         "cpus_per_rank": 1, "epochs": 3, "batch_size": 64, "lr": 0.01},
                                               "evaluate": {"gate": "abs_error <= 0.6"}})
    add_table_workload(project)
    env = {**slurm, **project_env(project, MLFLOW_TRACKING_URI=tracking_server, MNIST_SOURCE=str(mnist_dir),
                                  **CREDENTIALS)}
    proc = hosts[0].run(["dvc", "repro", "evaluate"], cwd=project, env=env, timeout=TWO_NODE_TIMEOUT_S)
    logs = {name: sorted((project / folder).glob("slurm-*.out"))
            for name, folder in (("single", "models/single/logs"), ("dp", "models/dp/logs"),
                                 ("evaluate", "logs/evaluate"))}
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n" + "".join(
        p.read_text()[-3000:] for found in logs.values() for p in found)
    assert proc.stdout.count("submitting to Slurm (1 node(s))") == 3, proc.stdout
    for name, (job_log,) in logs.items():
        text = job_log.read_text()
        command = "evaluate" if name == "evaluate" else "train"
        # train.device: auto on a partition whose nodes hold GPUs (gres.conf): each job asks for its own
        assert re.search(rf"mnist-pipeline {command} on node-[ab]: GPUs: 1, CPUs: 1", text), text[-3000:]
    for mode in ("single", "dp"):
        assert f"{mode} epoch 3/3" in logs[mode][0].read_text()  # trained there, not here
        assert f"{mode}: test abs_error" in logs["evaluate"][0].read_text()
        assert json.loads((project / f"results/eval/{mode}.json").read_text())["abs_error"] <= 0.6
    # The job's runs are the stage's: each mode's run finished, with the test scores the job logged.
    runs = server_runs(hosts[0], tracking_server)
    for mode in ("single", "dp"):
        parent_id = json.loads((project / f"models/{mode}/mlflow_run.json").read_text())["parent"]
        (parent,) = [r for r in runs if r["id"] == parent_id]
        assert parent["status"] == "FINISHED" and "test_abs_error" in parent["metrics"], parent


def test_a_training_stopped_while_its_job_runs_cancels_the_job(hosts, slurm, mnist_dir, tmp_path):
    """Ctrl-C to `train --mode single` (train.launcher: slurm) while its job trains: the job is
    cancelled before the command lets go of models/single, not left writing there under the next
    training, and the command fails."""
    project = make_project(tmp_path / "proj", {**SMALL, "tracking": {"enabled": False},
                                               "train": {**SMALL["train"], "launcher": "slurm", "nodes": 1,
                                                         "nproc": 1, "cpus_per_rank": 1, "epochs": 60}})
    env = {**slurm, **project_env(project, MNIST_SOURCE=str(mnist_dir))}
    prepare(project, mnist_dir)  # by pytest's process: the emulated hosts share its disk
    proc = hosts[0].popen(["mnist-pipeline", "train", "--mode", "single"], cwd=project, env=env,
                          log=tmp_path / "train.log")

    def jobs() -> list[str]:
        out = hosts[0].run(["squeue", "-h", "-o", "%j %T"], cwd=project, env=env, timeout=30).stdout
        return [line for line in out.splitlines() if line.strip()]

    def training() -> bool:
        return any("single epoch 2/" in p.read_text() for p in (project / "models/single/logs").glob("slurm-*.out"))

    try:
        wait_until(training, "the job training", timeout=180, interval=1,
                   diagnose=lambda: (tmp_path / "train.log").read_text()[-3000:] + "\n".join(jobs()))
        (job,) = jobs()
        assert re.fullmatch(r"mnist-train-single-[0-9a-f]{8} RUNNING", job), job
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the command and sbatch alike
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    wait_until(lambda: not jobs(), "the job cancelled", timeout=60, interval=1, diagnose=lambda: "\n".join(jobs()))
    assert not (project / "models/single/model.pt").exists()


def test_dvc_repro_submits_ddp_to_slurm_and_an_interrupted_job_continues_on_the_next_repro(
        hosts, slurm, tracking_server, uninterrupted, mnist_dir, tmp_path):
    """The login node (node-a) runs `dvc repro`; with train.launcher: slurm the ddp stage submits
    deploy/slurm/train.sbatch with `sbatch --wait` over both hosts, in this shared directory, and
    so does commcheck before it. The first job dies after epoch 1 with no restart left in it, so
    sbatch and the stage fail. The next `dvc repro` submits a new job that continues: epoch 2 only,
    in the same MLflow runs, to the weights of a training never interrupted. (One test, not two:
    each `dvc repro` over Slurm costs a minute, and the continued training is the one that waited.)"""
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "launcher": "slurm",
                                                                  "nodes": 2, "nproc": 1, "cpus_per_rank": 1}})
    env = {**slurm, **project_env(project, GLOO_SOCKET_IFNAME=INTERFACE, MLFLOW_TRACKING_URI=tracking_server,
                                  MNIST_SOURCE=str(mnist_dir), **CREDENTIALS)}
    crashed = hosts[0].run(["dvc", "repro", "train@ddp"], cwd=project, timeout=TWO_NODE_TIMEOUT_S,
                           env={**env, "MNIST_PIPELINE_CRASH_AFTER_EPOCH": "1", "MAX_RESTARTS": "0"})
    assert crashed.returncode != 0 and "Slurm job" in crashed.stderr, crashed.stderr[-3000:]
    assert crashed.stdout.count("submitting to Slurm (2 node(s))") == 2, crashed.stdout[-3000:]  # commcheck, ddp
    assert (project / "models/ddp/unfinished.json").is_file()
    first = json.loads((project / "models/ddp/mlflow_run.json").read_text())

    resumed = hosts[0].run(["dvc", "repro", "train@ddp"], cwd=project, env=env, timeout=TWO_NODE_TIMEOUT_S)
    logs = sorted((project / "models/ddp/logs").glob("slurm-*.out"), key=lambda p: int(p.stem.split("-")[1]))
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:] + "".join(p.read_text()[-3000:] for p in logs)
    assert resumed.stdout.count("submitting to Slurm (2 node(s))") == 2, resumed.stdout[-3000:]  # commcheck, ddp
    assert re.search(r"^train: Slurm job \d+ finished", resumed.stdout, re.M), resumed.stdout[-3000:]
    assert "ddp: continuing the training interrupted in models/ddp" in output, output[-3000:]
    crashed_job, resumed_job = (p.read_text() for p in logs)
    assert "ddp epoch 1/2" in crashed_job and "crashing after epoch 1" in crashed_job
    assert "ddp epoch 1/2" not in resumed_job and "ddp epoch 2/2" in resumed_job, resumed_job[-3000:]
    assert "2 node(s) x 1 worker(s), rendezvous node-a" in resumed_job
    # Each job meets at a port of its own (from its id), so two jobs sharing a node do not collide.
    ports = [int(re.search(r"rendezvous node-a \([\d.]+:(\d+)\)", job).group(1)) for job in (crashed_job, resumed_job)]
    assert ports == [20000 + int(p.stem.split("-")[1]) % 10000 for p in logs] and ports[0] != ports[1], ports
    # train.device: auto asks for train.nproc GPUs where the partition holds them; train.cpus_per_rank
    # and train.mem_per_rank_gb (0.5: 512 MB) for each
    assert "GPUs per node: 1, CPUs per node: 1, memory per node: 512 MB" in resumed_job
    assert not (project / "models/ddp/unfinished.json").exists()
    summary = json.loads((project / "results/train/ddp.json").read_text())
    assert (summary["nodes"], summary["procs_per_node"]) == (2, 1)
    # commcheck went the same way, on each repro: it checked the link between the hosts that
    # training then used.
    verdict = json.loads((project / "checks/comm.json").read_text())
    assert verdict["passed"] and verdict["world_size"] == 2 and len(list((project / "checks/logs").iterdir())) == 2
    # The same global batches as the two hand-started agents: the same weights, bit for bit.
    assert max_abs_diff(load_weights(rank0_dir(uninterrupted[0]), "ddp"), load_weights(project, "ddp")) == 0.0

    assert json.loads((project / "models/ddp/mlflow_run.json").read_text()) == first  # the same runs, continued
    runs = server_runs(hosts[0], tracking_server)
    (parent,) = [r for r in runs if r["id"] == first["parent"]]
    children = [r for r in runs if r["tags"].get(PARENT) == first["parent"]]
    assert parent["status"] == "FINISHED" and [c["status"] for c in children] == ["FINISHED"] * 2
    assert {c["tags"]["host"] for c in children} == {"node-a", "node-b"}


def test_a_preemption_notice_requeues_the_job_which_goes_on_from_the_step_in_its_runs(
        hosts, slurm, tracking_server, uninterrupted, mnist_dir, tmp_path):
    """`scancel --batch --signal=USR1` (what `sbatch --signal=B:USR1@120` sends ahead of a time
    limit or a preemption) to a ddp job over both hosts, mid-training, with step checkpoints on: the
    workers stop after their next step, checkpointed, the job requeues itself, and started again it
    goes on from that step. The stage's `sbatch --wait` waits it out, and the weights are those of a
    training never interrupted (the module's two hand-started agents', which a job of the same
    global batches matches bit for bit: the dvc repro test above), in the same MLflow runs."""
    train = {**SMALL["train"], "nodes": 2, "nproc": 1, "cpus_per_rank": 1,
             "checkpoint_every_steps": 1000}  # never reached: the notice's checkpoint is the only one mid-epoch
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**train, "launcher": "slurm"}})
    prepare(project, mnist_dir)
    # Paused after each step (the weights are the same): the notice below reaches a training that
    # is still running, however long scancel and Slurm take to pass it on. Epoch 2's 10 steps then
    # last 10 s and more, as the 50 steps of 0.1 s of the 6 epochs this test trained before (a
    # two-host reference training of its own, against the module's).
    env = {**slurm, **project_env(project, GLOO_SOCKET_IFNAME=INTERFACE, MLFLOW_TRACKING_URI=tracking_server,
                                  MNIST_PIPELINE_STEP_PAUSE_S="1.0", **CREDENTIALS)}
    proc = hosts[0].popen(["mnist-pipeline", "train", "--mode", "ddp"], cwd=project, env=env,
                          log=tmp_path / "train.log")
    logs = project / "models/ddp/logs"

    def job_log() -> str:
        return "".join(p.read_text() for p in logs.glob("slurm-*.out")) if logs.is_dir() else ""

    try:
        wait_until(lambda: "ddp epoch 1/2" in job_log(), "the job's first epoch", timeout=TWO_NODE_TIMEOUT_S,
                   interval=0.5, diagnose=lambda: (tmp_path / "train.log").read_text()[-3000:] + job_log()[-3000:])
        (log,) = logs.glob("slurm-*.out")
        job = log.stem.split("-")[1]
        first = json.loads((project / "models/ddp/mlflow_run.json").read_text())
        notice = hosts[0].run(["scancel", "--batch", "--signal=USR1", job], cwd=project, env=env, timeout=30)
        assert notice.returncode == 0, notice.stderr
        proc.wait(timeout=TWO_NODE_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said, text = (tmp_path / "train.log").read_text(), log.read_text()
    assert proc.returncode == 0, said[-3000:] + text[-5000:]
    assert re.search(r"ddp: SIGTERM, so training stopped after step \d+ \(epoch [12], step", text), text[-5000:]
    assert re.search(rf"^mnist-ddp: preemption notice: ddp: SIGTERM, so training stopped after step \d+ .*; "
                     rf"requeueing job {job}$", text, re.M), text[-5000:]
    assert not list(project.glob(".mnist-pipeline-stopped-*"))  # the script's marker, read and gone
    # Epoch 1 ran once; the requeued job went on from the step after the notice, to the end.
    assert text.count("ddp epoch 1/2") == 1 and text.count("ddp epoch 2/2") == 1, text[-5000:]
    assert max_abs_diff(load_weights(rank0_dir(uninterrupted[0]), "ddp"), load_weights(project, "ddp")) == 0.0
    assert json.loads((project / "models/ddp/mlflow_run.json").read_text()) == first  # the same runs, continued
    runs = server_runs(hosts[0], tracking_server)
    (parent,) = [r for r in runs if r["id"] == first["parent"]]
    children = [r for r in runs if r["tags"].get(PARENT) == first["parent"]]
    assert parent["status"] == "FINISHED" and [c["status"] for c in children] == ["FINISHED"] * 2


def test_a_gpu_training_asks_slurm_for_its_gpus_and_fails_clearly_where_none_is_visible(hosts, slurm, mnist_dir,
                                                                                         tmp_path):
    """train.device: cuda asks the job for train.nproc GPUs a node, and Slurm grants them from its
    gres.conf. These hosts have no GPU, as on a cluster whose cgroups hide the devices: the worker
    fails at once, naming train.device, instead of training on the CPU."""
    project = make_project(tmp_path / "proj", {**SMALL, "tracking": {"enabled": False},
                                               "train": {**SMALL["train"], "launcher": "slurm", "nodes": 1,
                                                         "nproc": 1, "device": "cuda", "cpus_per_rank": 2}})
    env = {**slurm, **project_env(project, MNIST_SOURCE=str(mnist_dir))}
    prepare(project, mnist_dir)  # by pytest's process: the emulated hosts share its disk
    proc = hosts[0].run(["mnist-pipeline", "train", "--mode", "ddp"], cwd=project, env=env,
                        timeout=TWO_NODE_TIMEOUT_S)
    (job_log,) = sorted((project / "models/ddp/logs").glob("slurm-*.out"))
    log = job_log.read_text()
    assert proc.returncode != 0 and "Slurm job" in proc.stderr, proc.stderr[-3000:]
    # CPUs and memory too: train.cpus_per_rank and train.mem_per_rank_gb (0.5) x nproc
    assert "GPUs per node: 1, CPUs per node: 2, memory per node: 512 MB" in log, log[-3000:]
    assert "train.device is cuda, but no GPU is visible" in log, log[-3000:]
    # single trains on a node like DDP's, with one GPU of its own.
    proc = hosts[0].run(["mnist-pipeline", "train", "--mode", "single"], cwd=project, env=env,
                        timeout=TWO_NODE_TIMEOUT_S)
    (job_log,) = sorted((project / "models/single/logs").glob("slurm-*.out"))
    log = job_log.read_text()
    assert proc.returncode != 0 and "Slurm job" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"mnist-pipeline train on node-[ab]: GPUs: 1, CPUs: 2", log), log[-3000:]
    assert "train.device is cuda, but no GPU is visible" in log, log[-3000:]


def test_a_sweep_runs_as_one_array_job_and_comes_back_as_dvc_experiments(hosts, slurm, tracking_server, mnist_dir,
                                                                          tmp_path):
    """`mnist-pipeline sweep` on the login node (node-a): 4 experiments as 4 tasks of one array job,
    and the command returns before any is done. Each task clones the project's git remote at the
    commit, runs `dvc exp run` on its node, and pushes the experiment back. One task is cancelled
    mid-run: that experiment alone fails, `sweep rerun` runs it again, and once all are done,
    `sweep pull` brings them back: `make show` lists the 4 and MLflow has their runs by name."""
    project = make_project(tmp_path / "proj", {
        **SMALL, "commcheck": {"enabled": False}, "tracking": {"system_metrics": False},
        "train": {**SMALL["train"], "modes": ["single"], "launcher": "slurm", "nodes": 1, "nproc": 1, "cpus_per_rank": 1,
                  "epochs": 1}})
    remote = tmp_path / "remote.git"  # the team's git server; here a bare repository both hosts see
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    subprocess.run(["git", "remote", "add", "origin", str(remote)], cwd=project, check=True)  # nothing pushed yet
    env = {**slurm, **project_env(project, MLFLOW_TRACKING_URI=tracking_server, MNIST_SOURCE=str(mnist_dir),
                                  SWEEP_SCRATCH=str(tmp_path / "scratch"), **CREDENTIALS)}
    (tmp_path / "scratch").mkdir()

    def cli(*args: str) -> subprocess.CompletedProcess:
        proc = hosts[0].run(["mnist-pipeline", "sweep", *args], cwd=project, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    submitted = cli("-S", "train.lr=0.01,0.02", "-S", "train.epochs=1,2", "--name", "grid")
    sweep_id = re.search(r"^sweep (\S+): 4 experiments \(grid-1 \.\.\. grid-4\) submitted as Slurm array job (\d+)",
                         submitted.stdout, re.M)
    assert sweep_id, submitted.stdout
    sweep_id, job = sweep_id.groups()
    folder = project / ".sweeps" / sweep_id
    # Nothing is done when the command returns, and nothing of it runs here: the tasks are Slurm's.
    assert not [p for p in folder.glob("grid-*.json") if json.loads(p.read_text())["state"] == "done"]
    names = [f"grid-{n}" for n in range(1, 5)]

    def table() -> dict[str, str]:
        out = cli("status", sweep_id).stdout
        return {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("grid-")}

    def task_log(index: int) -> str:
        return "".join(p.read_text() for p in folder.glob(f"task-{index}-job-*.out"))

    # grid-2's task is cancelled once its experiment trains: it alone fails, the others go on.
    wait_until(lambda: "dvc exp run" in task_log(1), "grid-2 running its experiment", timeout=300, interval=1,
               diagnose=lambda: task_log(1))
    hosts[0].run(["scancel", f"{job}_1"], cwd=project, env=env, timeout=30)
    wait_until(lambda: set(table().values()) <= {"done", "failed"}, "every experiment finished", timeout=600,
               interval=3, diagnose=lambda: cli("status", sweep_id).stdout + "".join(task_log(i) for i in range(4)))
    states = table()
    assert states == {"grid-1": "done", "grid-2": "failed", "grid-3": "done", "grid-4": "done"}, cli("status").stdout
    assert re.search(r"^grid-2\s+failed \(stopped by SIGTERM\)", cli("status", sweep_id).stdout, re.M)

    again = cli("rerun", sweep_id)
    assert "grid-2 submitted again as Slurm array job" in again.stdout, again.stdout
    wait_until(lambda: table()["grid-2"] == "done", "grid-2 run again", timeout=600, interval=3,
               diagnose=lambda: cli("status", sweep_id).stdout + task_log(1))
    shown = cli("status", sweep_id).stdout
    assert all(re.search(rf"^{name}\s+done\s+\d+_\d\s+single=[0-9a-f]{{32}}", shown, re.M) for name in names), shown

    cli("pull", sweep_id)
    show = subprocess.run([sys.executable, str(ROOT / "scripts/show_experiments.py")],
                          cwd=project, capture_output=True, text=True, env=subprocess_env(**project_env(project)))
    assert show.returncode == 0 and all(name in show.stdout for name in names), show.stdout + show.stderr
    rows = {line.split()[0]: line for line in show.stdout.splitlines() if line.strip().startswith("grid-")}
    assert "0.01" in rows["grid-1"] and "0.02" in rows["grid-4"], show.stdout  # each its own overrides
    again_named = hosts[0].run(["mnist-pipeline", "sweep", "-S", "train.lr=0.01,0.02", "--name", "grid"], cwd=project,
                               env=env, timeout=120)
    assert again_named.returncode == 1 and "--name grid is taken by sweep" in again_named.stderr, again_named.stderr
    # An array Slurm refuses (more memory than a node has) leaves nothing: no record, no ref on the remote.
    too_big = hosts[0].run(["mnist-pipeline", "sweep", "-S", "train.mem_per_rank_gb=64", "--name", "big"], cwd=project,
                           env=env, timeout=120)
    assert too_big.returncode == 1 and "sweep: sbatch refused the array job" in too_big.stderr, too_big.stderr
    assert len(too_big.stderr.strip().splitlines()) == 1 and sorted(p.name for p in (project / ".sweeps").iterdir()) == [sweep_id]
    refs = subprocess.run(["git", "ls-remote", str(remote), "refs/sweeps/*"], capture_output=True, text=True).stdout
    assert [line.split()[1] for line in refs.splitlines()] == [f"refs/sweeps/{sweep_id}"], refs
    # MLflow groups them by experiment, as it does `dvc exp run`'s here: grid-N/single, finished.
    finished = {r["name"] for r in server_runs(hosts[0], tracking_server) if r["status"] == "FINISHED"}
    assert {f"{name}/single" for name in names} <= finished, finished
