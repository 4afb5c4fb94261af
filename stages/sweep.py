"""`mnist-pipeline sweep`: a grid of `-S` overrides as DVC experiments, each run on the cluster as a
task of one Slurm job array (or, `--on kubernetes`, as a Kubeflow TrainJob of its own:
stages/sweep_kubernetes.py), and nothing left running where it was submitted.

    mnist-pipeline sweep -S train.lr=0.01,0.02 -S train.epochs=1,2 --name lr-epochs
    mnist-pipeline sweep status            # queued, running, done or failed; job ids, MLflow runs
    mnist-pipeline sweep rerun ID [NAME]   # the failed ones (or those named) again, alone
    mnist-pipeline sweep pull ID           # `dvc exp pull` of the done ones: `make show` lists them

Each task (`sweep task`, in deploy/slurm/run.sbatch on its node) clones the project's git remote
at the submitted commit into a checkout of its own, runs the experiment's whole `dvc exp run`
there, every stage on that node, and pushes it with `dvc exp push` to the same remote (and its
outputs to the DVC remote, if the project has one). Its state goes to `.sweeps/<id>/` in this
directory, which the nodes share, as the Slurm stages' outputs do.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import yaml

from pipeline import sweep as grid
from pipeline.atomic import read_json, write_json
from pipeline.config import config_from_dict, read_config
from pipeline.errors import PipelineError
from stages import slurm
from stages import sweep_kubernetes as kubernetes

GIT_TIMEOUT_S = 120


def record_path(sweep_id: str) -> Path:
    return grid.SWEEPS_DIR / sweep_id / "sweep.json"


def read_record(sweep_id: str | None) -> dict:
    """The sweep `sweep_id`, or the newest one submitted here."""
    if sweep_id is None:
        found = sorted(grid.SWEEPS_DIR.glob("*/sweep.json"), key=lambda p: p.parent.name)  # ids start with the time
        if not found:
            raise PipelineError(f"no sweep was submitted from this directory ({grid.SWEEPS_DIR}/ is empty): "
                                "`mnist-pipeline sweep -S KEY=V1,V2` submits one")
        return read_json(found[-1], "submit the sweep again")
    path = record_path(sweep_id)
    if not path.is_file():
        known = sorted(p.parent.name for p in grid.SWEEPS_DIR.glob("*/sweep.json"))
        raise PipelineError(f"no sweep {sweep_id!r} in {grid.SWEEPS_DIR}/ (known: {', '.join(known) or 'none'})")
    return read_json(path, "submit the sweep again")


def git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)


def remote_url(name: str) -> str:
    """The git remote the nodes clone, as they must name it: a local path made absolute."""
    found = git("remote", "get-url", name)
    if found.returncode != 0:
        raise PipelineError(f"sweep: no git remote {name!r} here; the nodes clone the project from one and the "
                            f"experiments are pushed back to it: `git remote add {name} URL` (or --remote NAME)")
    url = found.stdout.strip()
    if "://" not in url and not (":" in url.split("/")[0] and not url.startswith("/")):  # a path, not host:path
        url = str(Path(url).resolve())
    return url


def check_tracking(configs) -> None:
    """Each experiment runs in a checkout on a node, deleted after its push: a store that is a
    file in that checkout would be deleted with it."""
    from pipeline.tracking.store import check_store, is_local_file, shown, tracking_uri

    if not any(config.tracking.enabled for config in configs):
        return
    uri = tracking_uri()
    if is_local_file(uri):
        raise PipelineError(
            f"sweep: the tracking store is {shown(uri)}, a file, but each experiment runs in a checkout of its own on "
            "a node: set MLFLOW_TRACKING_URI to a tracking server the nodes reach, or tracking.enabled: false")
    check_store(uri)


def check_one_node(configs) -> None:
    for config in configs:
        if config.train.nodes != 1:
            raise PipelineError(f"sweep: train.nodes = {config.train.nodes}, but each experiment of a sweep runs in "
                                "one job on one node; set train.nodes: 1 for the sweep")


def resources(configs) -> list[str]:
    """What each task asks Slurm for: one node, and the most GPUs, CPUs and memory any experiment
    needs (they may sweep train.nproc, cpus_per_rank or mem_per_rank_gb); checked as every Slurm
    stage checks its job (sbatch here, the controller answers)."""
    gpus, cpus, megabytes = None, 0, 0
    slurm.check_ready(configs[0], slurm.Job(slurm.ONE_PROCESS_SCRIPT, 1, configs[0].train.nproc or None))
    for config in configs:
        job = slurm.Job(slurm.ONE_PROCESS_SCRIPT, 1, config.train.nproc or None)
        asked = slurm.gpus_asked(config, job)  # each experiment's GPU request checked
        gpus = asked if gpus is None else max(gpus, asked or 0)
        cpus = max(cpus, int(slurm.cpu_request(config, job, asked)[1]))
        megabytes = max(megabytes, int(slurm.memory_request(config, job, asked)[1].removesuffix("M")))
    return ["--nodes", "1", *slurm.gpu_request(gpus), "--cpus-per-task", str(cpus), "--mem", f"{megabytes}M"]


def submit_tasks(record: dict, indices: list[int]) -> str:
    """One array job for these experiments of the sweep; its id. Nothing waits for it."""
    folder = record_path(record["id"]).parent
    array = ",".join(str(i) for i in indices)
    # --no-requeue: a task stopped by Slurm stays failed, for `sweep rerun`, rather than coming back
    # under the same job id beside the state it wrote.
    sbatch = ["sbatch", "--parsable", "--no-requeue", f"--array={array}", "--job-name", f"mnist-sweep-{record['id']}",
              "--output", str(folder / "task-%a-job-%A.out"), *record["request"], str(slurm.ONE_PROCESS_SCRIPT),
              "sweep", "task", str(record_path(record["id"]))]
    try:
        done = subprocess.run(sbatch, capture_output=True, text=True, timeout=slurm.SLURM_PING_TIMEOUT_S * 2)
    except BaseException as exc:  # no answer in time, or Ctrl-C: a job it may have queued must go too
        slurm.cancel(f"mnist-sweep-{record['id']}")
        if isinstance(exc, subprocess.TimeoutExpired):
            raise PipelineError(f"sweep: sbatch did not answer within {exc.timeout:.0f} s; check Slurm's "
                                "controller (scontrol ping)") from None
        raise
    if done.returncode != 0:
        raise PipelineError(f"sweep: sbatch refused the array job ({' '.join((done.stderr or done.stdout).split())[:300]})")
    job = done.stdout.strip().split(";")[0]
    for index in indices:
        record["experiments"][index]["job"] = f"{job}_{index}"
    write_json(record_path(record["id"]), record)
    return job


@click.group(invoke_without_command=True)
@click.option("-S", "--set", "options", multiple=True, metavar="KEY=V1,V2",
              help="A param and the values to sweep it over; several -S make a grid.")
@click.option("--name", default=None, help="The experiments' names: NAME-1, NAME-2, ... (default: sweep-ID).")
@click.option("--remote", default="origin", show_default=True,
              help="The git remote the nodes clone the project from, and push the experiments to.")
@click.option("--on", "where", type=click.Choice(["slurm", "kubernetes"]), default="slurm", show_default=True,
              help="One Slurm array task, or one Kubeflow TrainJob, per experiment.")
@click.option("--manifests-only", is_flag=True,
              help="kubernetes: write the TrainJobs into .sweeps/ID/ without applying them.")
@click.pass_context
def sweep(ctx: click.Context, options: tuple[str, ...], name: str | None, remote: str, where: str,
          manifests_only: bool) -> None:
    """Run a grid of -S overrides as DVC experiments on the cluster, one Slurm array task (or one
    Kubeflow TrainJob) each."""
    if ctx.invoked_subcommand is not None:
        if options or name:
            raise click.UsageError("-S and --name come without a sub-command: `mnist-pipeline sweep -S KEY=V1,V2`")
        return
    if manifests_only and where != "kubernetes":
        raise click.UsageError("--manifests-only goes with --on kubernetes")
    _, text = read_config("params.yaml")
    raw = yaml.safe_load(text)
    sweep_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    found = grid.experiments(raw, list(options), name or f"sweep-{sweep_id}")
    configs = [config_from_dict(grid.apply(raw, e.overrides, "params.yaml")) for e in found]
    check_one_node(configs)
    check_tracking(configs)
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.split("\n")[0].strip()
    if dirty:
        raise PipelineError(f"sweep: uncommitted changes ({dirty} ...); the nodes run the committed code: commit "
                            "them first")
    commit = git("rev-parse", "HEAD").stdout.strip()
    url = remote_url(remote)
    reachable = git("ls-remote", "-q", "--heads", remote)
    if reachable.returncode != 0:
        raise PipelineError(f"sweep: git remote {remote!r} ({url}) cannot be reached from here "
                            f"({' '.join(reachable.stderr.split())[:300]}); the nodes clone the project from it: fix "
                            "it, or name another with --remote")
    check_unused(found[0].name.rsplit("-", 1)[0], git("ls-remote", "-q", remote, "refs/exps/*").stdout)
    if where == "slurm":
        request = resources(configs)
    else:
        request = None
        kubernetes.check_configs(configs)
        if not manifests_only:
            kubernetes.check_kubectl()
        template = kubernetes.TEMPLATE.read_text() if kubernetes.TEMPLATE.is_file() else None
        if template is None:
            raise PipelineError(f"sweep: {kubernetes.TEMPLATE} is missing; run from the project's root directory")
    # The nodes fetch the commit by this ref: it reaches the remote even where no branch holds it.
    pushed = git("push", "-q", remote, f"HEAD:refs/sweeps/{sweep_id}")
    if pushed.returncode != 0:
        raise PipelineError(f"sweep: git push {remote} HEAD:refs/sweeps/{sweep_id} failed "
                            f"({' '.join(pushed.stderr.split())[:300]}); the nodes fetch the commit from there")
    record = {"id": sweep_id, "on": where, "commit": commit, "remote": remote, "url": url, "submitted": time.time(),
              "request": request, "experiments": [
                  {**e.as_dict(), "job": kubernetes.job_name(sweep_id, i) if where == "kubernetes" else None}
                  for i, e in enumerate(found)]}
    try:
        write_json(record_path(sweep_id), record)
        if where == "slurm":
            job = submit_tasks(record, list(range(len(found))))
            how = f"submitted as Slurm array job {job}"
        else:
            every = kubernetes.write(record_path(sweep_id).parent, kubernetes.manifests(record, configs, template))
            if manifests_only:
                how = f"written as TrainJobs: `kubectl apply -f {every}` submits them"
            else:
                kubernetes.submit(every)
                how = f"submitted as {len(found)} TrainJobs (kubectl get trainjobs -l {kubernetes.LABEL}={sweep_id})"
    except BaseException:  # nothing submitted: nothing of the sweep is left here or on the remote
        shutil.rmtree(record_path(sweep_id).parent, ignore_errors=True)
        git("push", "-q", remote, f":refs/sweeps/{sweep_id}")
        raise
    click.echo(f"sweep {sweep_id}: {len(found)} experiments ({found[0].name} ... {found[-1].name}) {how}; nothing "
               "here waits for them")
    click.echo(f"  `mnist-pipeline sweep status {sweep_id}`; once done, `mnist-pipeline sweep pull {sweep_id}`")


def check_unused(prefix: str, remote_refs: str) -> None:
    """An experiment's name is the sweep's own: one that another sweep here or an experiment on
    the remote has would make `dvc exp push` overwrite it, or `sweep pull` bring back the other."""
    for path in grid.SWEEPS_DIR.glob("*/sweep.json"):
        if any(e["name"].rsplit("-", 1)[0] == prefix for e in read_json(path, "remove that sweep's folder")["experiments"]):
            raise PipelineError(f"sweep: --name {prefix} is taken by sweep {path.parent.name}; choose another")
    for line in remote_refs.splitlines():
        name = line.rsplit("/", 1)[-1]
        if line.split()[-1].startswith("refs/exps/") and name.rsplit("-", 1)[0] == prefix:
            raise PipelineError(f"sweep: the remote already holds an experiment {name}; choose another --name")


def queue_states(record: dict) -> dict[str, str]:
    """Slurm's state of each of the sweep's tasks still in its queue: {"123_0": "RUNNING"}."""
    try:
        listed = subprocess.run(["squeue", "-h", "-r", "-n", f"mnist-sweep-{record['id']}", "-o", "%i %T"],
                                capture_output=True, text=True, timeout=slurm.SLURM_PING_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PipelineError(f"sweep: cannot read Slurm's queue ({exc}); check SLURM_CONF") from None
    if listed.returncode != 0:
        raise PipelineError(f"sweep: squeue failed ({listed.stderr.strip()[:300]}); check SLURM_CONF")
    return dict(line.split()[:2] for line in listed.stdout.splitlines() if len(line.split()) >= 2)


def states(record: dict) -> list[tuple[dict, str, dict | None]]:
    """Each experiment, its state, and what its job wrote (on Kubernetes: its TrainJob's conditions)."""
    if record.get("on") == "kubernetes":
        jobs = kubernetes.jobs_of(record)
        return [(e, kubernetes.state_of(jobs.get(e["job"])), None) for e in record["experiments"]]
    queue = queue_states(record)
    folder = record_path(record["id"]).parent
    found = []
    for experiment in record["experiments"]:
        path = folder / f"{experiment['name']}.json"
        written = read_json(path, "run the experiment again (`sweep rerun`)") if path.is_file() else None
        if written is not None and written.get("job") != experiment["job"]:
            written = None  # an earlier job's: the rerun's has not started
        found.append((experiment, grid.state(written, queue.get(experiment["job"] or "")), written))
    return found


@sweep.command()
@click.argument("sweep_id", required=False)
def status(sweep_id: str | None) -> None:
    """Each experiment's state (queued, running, done, failed), its job and its MLflow runs."""
    record = read_record(sweep_id)
    rows = []
    for experiment, state, written in states(record):
        runs = " ".join(f"{mode}={run}" for mode, run in (written or {}).get("runs", {}).items()) or "-"
        why = f" ({written['why']})" if state == "failed" and written and written.get("why") else ""
        if state == "failed" and written is None and record.get("on") != "kubernetes":
            why = " (its job ended without a word: killed, or its node failed)"
        rows.append((experiment["name"], state + why, experiment["job"] or "-", runs, " ".join(experiment["overrides"])))
    click.echo(f"sweep {record['id']} (commit {record['commit'][:12]}, remote {record['remote']})")
    widths = [max(len(row[i]) for row in rows + [("experiment", "state", "job", "MLflow runs", "")]) for i in range(4)]
    for row in [("experiment", "state", "job", "MLflow runs", "-S")] + rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])


@sweep.command()
@click.argument("sweep_id")
@click.argument("names", nargs=-1)
def rerun(sweep_id: str, names: tuple[str, ...]) -> None:
    """Submit the sweep's failed experiments again (or those NAMES), each alone as before."""
    record = read_record(sweep_id)
    found = {experiment["name"]: (index, state) for index, (experiment, state, _) in enumerate(states(record))}
    for name in names:
        if name not in found:
            raise PipelineError(f"sweep {sweep_id}: no experiment {name!r} (it has {', '.join(found)})")
        if found[name][1] != "failed":
            raise PipelineError(f"sweep {sweep_id}: {name} is {found[name][1]}; only a failed experiment runs again")
    chosen = list(names) or [name for name, (_, state) in found.items() if state == "failed"]
    if not chosen:
        raise PipelineError(f"sweep {sweep_id}: no experiment failed; nothing to run again")
    if record.get("on") == "kubernetes":
        kubernetes.check_kubectl()
        folder = record_path(sweep_id).parent
        for name in chosen:
            kubernetes.apply_again(folder, record["experiments"][found[name][0]]["job"])
        click.echo(f"sweep {sweep_id}: {', '.join(chosen)} submitted again as TrainJobs")
        return
    job = submit_tasks(record, [found[name][0] for name in chosen])  # as first asked: the submitted commit's params
    click.echo(f"sweep {sweep_id}: {', '.join(chosen)} submitted again as Slurm array job {job}")


@sweep.command()
@click.argument("sweep_id", required=False)
def pull(sweep_id: str | None) -> None:
    """`dvc exp pull` the sweep's done experiments from its git remote (and their outputs from the
    DVC remote): then `make show` lists them beside the workspace's."""
    record = read_record(sweep_id)
    done = [(experiment["name"], written) for experiment, state, written in states(record) if state == "done"]
    if not done:
        raise PipelineError(f"sweep {record['id']}: no experiment is done yet (`mnist-pipeline sweep status`)")
    # By full ref: a name alone is ambiguous where another commit has an experiment of that name.
    commit = record["commit"]
    refs = [f"refs/exps/{commit[:2]}/{commit[2:]}/{name}" for name, _ in done]
    # Outputs too, where every task pushed them to a DVC remote and this workspace has one.
    with_outputs = dvc_remote() and all((written or {}).get("dvc_remote", True) for _, written in done)
    pulled = subprocess.run(["dvc", "exp", "pull", *([] if with_outputs else ["--no-cache"]), record["remote"], *refs],
                            capture_output=True, text=True)
    if pulled.returncode != 0:
        raise PipelineError(f"sweep: dvc exp pull failed ({' '.join((pulled.stderr or pulled.stdout).split())[:300]})")
    click.echo(f"sweep {record['id']}: pulled {', '.join(name for name, _ in done)}; `make show` lists them "
               f"(`make show ARGS=-A` once the workspace has moved on from commit {commit[:12]})")


def dvc_remote(cwd: Path | None = None, env: dict | None = None) -> str | None:
    """The project's default DVC remote, if it has one: where `dvc exp push` and `pull` take the
    experiments' outputs (without one they move the git part alone)."""
    named = subprocess.run(["dvc", "remote", "default"], cwd=cwd, env=env, capture_output=True, text=True)
    return named.stdout.strip() if named.returncode == 0 and named.stdout.strip() else None


def write_state(path: Path | None, state: dict) -> None:
    if path is not None:  # a TrainJob's pod has none: its conditions say it
        write_json(path, state)


class _Stopped(Exception):
    pass


def _stop(signum, frame) -> None:
    signal.signal(signum, signal.SIG_IGN)  # Slurm may say it again: the first one is being handled
    raise _Stopped(signal.Signals(signum).name)


@sweep.command(hidden=True)
@click.argument("record_file", type=click.Path(path_type=Path), required=False)
def task(record_file: Path | None) -> None:
    """One experiment of a sweep: its Slurm array task (the sweep's record, SLURM_ARRAY_TASK_ID
    picks the experiment; its state goes beside the record), or its TrainJob's pod (SWEEP_TASK
    holds the experiment; the TrainJob's conditions are its state)."""
    if record_file is None:
        try:
            record, index = json.loads(os.environ[kubernetes.TASK_ENV]), 0
        except (KeyError, ValueError):
            raise PipelineError(f"sweep task: give the sweep's record, or {kubernetes.TASK_ENV} (a TrainJob's)") from None
        job, state_file = record["experiments"][0]["job"], None
    else:
        index = int(os.environ.get("SLURM_ARRAY_TASK_ID", "-1"))
        record = read_json(record_file, "submit the sweep again")
        if not 0 <= index < len(record["experiments"]):
            raise PipelineError(f"sweep task: SLURM_ARRAY_TASK_ID={index} names no experiment of {record_file}")
        job = f"{os.environ.get('SLURM_ARRAY_JOB_ID', '?')}_{index}"
        state_file = record_file.parent / f"{record['experiments'][index]['name']}.json"
    experiment = record["experiments"][index]
    name = experiment["name"]
    started = {"state": "running", "job": job, "host": socket.gethostname(), "started": time.time()}
    write_state(state_file, started)
    scratch = Path(os.environ.get("SWEEP_SCRATCH") or os.environ.get("TMPDIR") or "/tmp")
    # A new folder of this user's (0700), not a name another user of a shared /tmp could make first
    # and fill: its code would run here.
    checkout = Path(tempfile.mkdtemp(prefix=f"mnist-sweep-{record['id']}-{name}-", dir=scratch))
    # The checkout's own code, not what an editable install or PYTHONPATH points at (the submitting
    # workspace, which may have moved on since).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    # run.sbatch turns the warm server off for its one command; the experiment's stages share one.
    env.pop("MNIST_PIPELINE_WARM", None)
    signal.signal(signal.SIGTERM, _stop)  # scancel, or the job's time limit
    step, child = "clone", None
    try:
        outputs_to = None
        steps = [("clone", ["git", "clone", "-q", "--no-checkout", record["url"], str(checkout)], scratch),
                 ("fetch", ["git", "fetch", "-q", "origin", f"refs/sweeps/{record['id']}"], checkout),
                 ("checkout", ["git", "checkout", "-q", "--detach", record["commit"]], checkout),
                 ("dvc exp run", ["dvc", "exp", "run", "-n", name,
                                  *[arg for override in experiment["overrides"] for arg in ("-S", override)]], checkout),
                 ("dvc exp push", None, checkout)]
        for step, argv, cwd in steps:
            if step == "dvc exp push":
                outputs_to = dvc_remote(checkout, env)
                # --force: the name is this sweep's own (checked at submission); a rerun replaces
                # what a failed try may have pushed, where DVC would keep it and exit 0.
                argv = ["dvc", "exp", "push", "--force", *([] if outputs_to else ["--no-cache"]), "origin", name]
            click.echo(f"sweep {record['id']} {name}: {step}", err=True)
            child = subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True)
            if child.wait() != 0:
                raise PipelineError(f"{step} exited with {child.returncode}")
        runs = {ids.parent.name: read_json(ids, "").get("parent")
                for ids in sorted((checkout / "models").glob("*/mlflow_run.json"))}
        write_state(state_file, {**started, "state": "done", "finished": time.time(),
                                "runs": {mode: run for mode, run in runs.items() if run}, "dvc_remote": outputs_to})
        shutil.rmtree(checkout, ignore_errors=True)
        click.echo(f"sweep {record['id']} {name}: done, pushed to origin ({record['url']})", err=True)
    except (PipelineError, _Stopped, OSError, subprocess.SubprocessError) as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        why = f"stopped by {exc}" if isinstance(exc, _Stopped) else f"{step}: {exc}"
        # Said first: Slurm kills what is left of the job KillWait (30 s by default) after its SIGTERM.
        write_state(state_file, {**started, "state": "failed", "finished": time.time(), "why": why,
                                "checkout": str(checkout)})
        if child is not None:  # the step's whole process group, its leader gone or not
            for stop, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
                try:
                    os.killpg(child.pid, stop)
                    child.wait(timeout=wait_s)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        kept = "" if state_file is None else f"; its checkout is kept in {checkout}"  # a pod's goes with it
        click.echo(f"sweep {record['id']} {name}: failed ({why}){kept}", err=True)
        sys.exit(1)
