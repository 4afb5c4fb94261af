"""Re-make a mode's training from its MLflow record alone, and say whether it came out bit for bit.

The record (pipeline.record, on every run) names the commit and keeps a dirty tree's patch; the
parent run holds the params file the training read and the model it made. A reproduction checks
out that commit into a temporary folder, applies the patch, puts the params back, checks that the
code is the code the run recorded, and trains the same mode there with the same command the
pipeline runs (DDP through its launcher), logging to the same store. The workspace, its outputs and
models/ are not touched. Its weights' digest is then set against the record's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline import record
from pipeline.config import MODES, distributed
from pipeline.errors import PipelineError
from pipeline.tracking.model import download_weights
from pipeline.tracking.recorded import RunStore
from pipeline.tracking.runs import PARENT_TAG
from pipeline.tracking.store import check_store, shown, store_errors, tracking_uri

DIFFERS, REFUSED, FAILED = 1, 2, 3  # exit codes; 0 is bit for bit; stopped: 128 + the signal
BIT_FOR_BIT = "reproduced bit for bit"
# What the record says about where and from what a run was made: each one that differs between the
# run and its reproduction is named in the verdict.
COMPARED = ("python_version", "torch_version", "cuda_version", "cudnn_version", "nccl_version", "cpu_model",
            "gpu_names", "driver_version", "nccl_env", "cpu_threads", "usable_cpus", "device_type", "world_size", "backend", "code_sha256", "params_sha256",
            "requirements_lock_sha256", "data_sha256", "image_base", "image_source_commit")
PARAMS_ARTIFACT = "params.yaml"  # on the parent run: the params file as the training read it
PREPARED = Path("data/prepared")  # where `dvc repro` prepares the data and trains from it


class Refusal(PipelineError):
    """What a reproduction cannot start without (exit 2): said in one line."""


class Stopped(BaseException):
    """A stop signal (Ctrl-C, SIGTERM) ended the reproduction: after the stage it was running (if
    any) ended too, and before its checkout is removed. Exit 128 + the signal, never 1 ("differs")."""

    def __init__(self, signum: int, during: str | None = None):
        super().__init__(signal.Signals(signum).name)
        self.code, self.during = 128 + signum, during


_child: subprocess.Popen | None = None  # the stage the reproduction is running
_launching = False  # starting it: a signal now is passed on as soon as it runs
_passed: list[int] = []  # the stop signals passed on to it, each kind once


def _on_stop(signum, frame) -> None:
    """While a stage starts or runs, pass each kind of stop signal on to it once (a Ctrl-C from a
    terminal reached it already: it ignores the second) and let it end its runs; _run raises once
    it is gone. Otherwise stop now."""
    if not (_launching or _child is not None):
        raise Stopped(signum)
    if signum not in _passed:
        _passed.append(signum)
        if _child is not None:
            _child.send_signal(signum)


@contextmanager
def stops_cleanly() -> Iterator[None]:
    """SIGTERM and Ctrl-C unwind the reproduction (its temporary checkout is removed) and never
    leave the training it started running on its own. Where Ctrl-C is ignored (nohup, `&`) it stays so."""
    _passed.clear()
    stops = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is signal.default_int_handler
                                else [])
    previous = {sig: signal.signal(sig, _on_stop) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class Recorded:
    """A mode's parent run, as much of it as a reproduction needs."""

    run_id: str
    mode: str
    tags: dict[str, str]
    params: dict[str, str]  # as logged: flattened, and the world size and batch shares besides
    params_text: str
    patch: bytes


def read_record(store: RunStore, run_id: str) -> Recorded:
    """The run's record, or a Refusal that names what is missing."""
    run = store.run(run_id)
    if run is None:
        raise Refusal(f"run {run_id}: no such run in the tracking store {shown(store.uri)} (is "
                      "MLFLOW_TRACKING_URI the store it was logged to?)")
    tags, name = run.tags, run.name
    if PARENT_TAG in tags:
        parent = tags[PARENT_TAG]
        raise Refusal(f"run {run_id} is {name!r}, one rank's run: reproduce the mode's run it belongs to, "
                      f"`mnist-pipeline reproduce {parent}`")
    # By its tags, not its name, which the MLflow UI lets anyone change.
    if tags.get("mode") not in MODES:
        raise Refusal(f"run {run_id} is {name!r}, not a training: reproduce takes a mode's run "
                      f"({', '.join(MODES)}), as `mnist-pipeline compare` lists them")
    if run.status != "FINISHED":
        raise Refusal(f"run {run_id} ({name}) is {run.status}: only a finished training can be re-made "
                      "and compared")
    if tags.get("git_commit", "unknown") == "unknown":
        tags = dict(tags, **commit_of_image(run_id, name, tags))
    patch = b""
    if tags.get("git_dirty") != "false":
        if "git_patch" not in tags:
            raise Refusal(f"run {run_id} ({name}) was trained from a tree with uncommitted changes and kept no "
                          f"patch of them (made before runs kept one): commit {tags['git_commit'][:12]} alone is "
                          "not the code that ran")
        patch = _artifact_bytes(store, run_id, tags["git_patch"], "its uncommitted change")
    params_text = _artifact_bytes(store, run_id, PARAMS_ARTIFACT, "the params file it read").decode()
    for key in ("code_sha256", "world_size", "device_type"):
        if key not in tags:
            raise Refusal(f"run {run_id} ({name}) has no {key} tag (made before runs recorded it): nothing to "
                          "check a reproduction against")
    return Recorded(run_id, tags["mode"], tags, run.params, params_text, patch)


def commit_of_image(run_id: str, name: str, tags: dict[str, str]) -> dict[str, str]:
    """A run trained where git could not look (the self-contained image has no .git): the commit
    its image was built from, as the build's `git describe --always --dirty --abbrev=40` named it
    (a full id, "TAG-N-g<id>", or a tag), as a clean tree of that commit; the code digest then
    checks that the image's code was that."""
    source = tags.get("image_source_commit", "")
    if source.endswith("-dirty"):
        raise Refusal(f"run {run_id} ({name}) ran in an image built from a tree with uncommitted changes "
                      f"({source}), which the image keeps no patch of: build it from a commit")
    found = re.fullmatch(r"(?:.+-g)?([0-9a-f]{40})", source)
    commit = found.group(1) if found else (
        record.git("rev-parse", "--verify", "--quiet", f"{source}^{{commit}}", cwd=record.project_folder()).strip()
        if source and source != "unknown" else "")
    if commit:
        return {"git_commit": commit, "git_dirty": "false"}
    raise Refusal(f"run {run_id} ({name}) records no commit (it was trained outside a git repository"
                  + (f", in an image built from {source!r}, which this repository does not name)" if source else ")"))


def _artifact_bytes(store: RunStore, run_id: str, path: str, what: str) -> bytes:
    try:
        return store.artifact_bytes(run_id, path)
    except Exception as exc:
        raise Refusal(f"run {run_id}: {what} ({path}) is not among its artifacts ({exc})") from None


def logged_weights(run_id: str, folder: Path, uri: str) -> dict:
    """The weights the run logged (its MLflow model's model.pt), before anything is trained."""
    import torch

    try:
        path = download_weights(f"runs:/{run_id}/model", folder, uri)
    except Exception as exc:
        raise Refusal(f"run {run_id}: its logged model is not there to compare with ({exc})") from None
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def check_host(recorded: Recorded, root: Path) -> None:
    """What this host and repository must give for the same training: the commit, and the devices."""
    commit = recorded.tags["git_commit"]
    if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=root, capture_output=True).returncode:
        raise Refusal(f"run {recorded.run_id}: its commit {commit[:12]} is not in the repository {root}; fetch it "
                      "(git fetch) and run again")
    # As the run's own code read them: this code's checks may not hold for an older params file.
    train = (_yaml(recorded.params_text) or {}).get("train") or {}
    nodes, launcher, device = train.get("nodes", 1), train.get("launcher", "local"), train.get("device", "auto")
    if nodes != 1 and launcher == "local":
        raise Refusal(f"run {recorded.run_id} ran on {nodes} nodes under torchrun; a reproduction "
                      "runs on this host (or through train.launcher: slurm)")
    from pipeline.gpus import cuda_device_count

    gpus = cuda_device_count()
    ran_on = recorded.tags["device_type"]
    needed = devices_used(recorded)
    if ran_on == "cuda" and gpus < needed and launcher == "local":
        raise Refusal(f"run {recorded.run_id} ({recorded.mode}) trained on {needed} CUDA device(s); this host has "
                      f"{gpus}: run the reproduction where {needed} GPU(s) are visible")
    if ran_on == "cpu" and gpus and device != "cpu":
        raise Refusal(f"run {recorded.run_id} ({recorded.mode}) trained on the CPU, but train.device: "
                      f"{device} trains on this host's GPUs: hide them (CUDA_VISIBLE_DEVICES=) and run "
                      "again")


def devices_used(recorded: Recorded) -> int:
    """The GPUs (or CPU processes) the run trained on: DDP's world, DataParallel's shares of a batch
    ('43/43/42', or '6x8/5x16' for runs of equal ones), one for single."""
    if distributed(recorded.mode):
        return int(recorded.tags["world_size"])
    shares = recorded.params.get("batch_shares") or ""
    if recorded.mode != "dp" or not shares:
        return 1
    return sum(int(part.split("x")[1]) if "x" in part else 1 for part in shares.split("/"))


def visible_devices(recorded: Recorded) -> dict[str, str]:
    """On a host with more GPUs than the run had, only as many for the reproduction: DataParallel
    splits over every visible GPU, and DDP's default nproc starts a worker per GPU."""
    from pipeline.gpus import cuda_device_count

    if recorded.tags["device_type"] != "cuda" or cuda_device_count() <= devices_used(recorded):
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(cuda_device_count())]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[:devices_used(recorded)])}


def _yaml(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def prepare_checkout(recorded: Recorded, root: Path, folder: Path) -> Path:
    """The recorded code and params in `folder`: the commit, its patch, the params file."""
    checkout = folder / "checkout"
    # The commit's bytes and the patch's, whatever the user's git config says: no line-end
    # conversion on checkout, no whitespace "fixes" on apply (the patch is already what ran).
    git = ["git", "-c", "advice.detachedHead=false", *record.BYTE_EXACT_GIT]
    for args, cwd in ((["clone", "--quiet", "--shared", "--no-checkout", str(root), str(checkout)], root),
                      (["checkout", "--quiet", "--detach", recorded.tags["git_commit"]], checkout)):
        done = subprocess.run([*git, *args], cwd=cwd, capture_output=True, text=True)
        if done.returncode:
            raise PipelineError(f"git {args[0]} for the reproduction failed: {done.stderr.strip()}")
    changes, submodules = split_patch(recorded.patch, gitlinks(checkout, git))
    check_out_submodules(root, checkout, git, submodules, recorded.run_id)
    if changes:
        patch = folder / "uncommitted.patch"
        patch.write_bytes(changes)
        done = subprocess.run([*git, "apply", "--binary", "--whitespace=nowarn", str(patch)], cwd=checkout,
                              capture_output=True, text=True)
        if done.returncode:
            raise Refusal(f"run {recorded.run_id}: its uncommitted change does not apply to commit "
                          f"{recorded.tags['git_commit'][:12]}: {done.stderr.strip().splitlines()[0]}")
    (checkout / "params.yaml").write_text(recorded.params_text)
    code = record.code_digest(record.code_folders_in(checkout))
    if code != recorded.tags["code_sha256"]:
        raise Refusal(f"run {recorded.run_id}: commit {recorded.tags['git_commit'][:12]} with its patch is not the "
                      "code it ran (code_sha256 differs): it ran files git does not track (untracked, or ignored), "
                      "or a .gitattributes filter changed the bytes git checks out")
    return checkout


# A submodule's part of `git diff HEAD`: its commit in the project's tree, then the one checked
# out ("-dirty" when its files have changes of their own, which the diff does not hold).
SUBPROJECT = re.compile(rb"^\+Subproject commit ([0-9a-f]{40})(-dirty)?$", re.M)


def gitlinks(checkout: Path, git: list[str]) -> dict[str, str]:
    """The submodules of the commit checked out: path -> the commit the project's tree holds."""
    tree = subprocess.run([*git, "ls-tree", "-r", "-z", "HEAD"], cwd=checkout, capture_output=True).stdout
    links = {}
    for entry in tree.split(b"\0"):
        if entry.startswith(b"160000 "):
            meta, _, name = entry.partition(b"\t")
            links[name.decode()] = meta.split()[2].decode()
    return links


def split_patch(patch: bytes, links: dict[str, str]) -> tuple[bytes, dict[str, tuple[str, bool]]]:
    """The patch less its submodules' sections (git apply cannot move a submodule), and each
    submodule's commit as the training had it: path -> (commit, whether it was dirty)."""
    kept, submodules = [], {}
    for part in re.split(rb"(?m)^(?=diff --git )", patch):
        header = re.match(rb"diff --git a/(.*?) b/", part)
        found = SUBPROJECT.search(part)
        if header and found and header.group(1).decode() in links:
            submodules[header.group(1).decode()] = (found.group(1).decode(), bool(found.group(2)))
        else:
            kept.append(part)
    return b"".join(kept), submodules


def check_out_submodules(source: Path, checkout: Path, git: list[str], moved: dict[str, tuple[str, bool]],
                         run_id: str, prefix: str = "") -> None:
    """Each submodule of the checkout at the commit the training had, cloned from the workspace's
    own checkout of it (no network), its submodules after it. What cannot be re-made is refused
    before anything trains: a submodule with changes of its own, or one the workspace lacks."""
    for path, recorded_commit in gitlinks(checkout, git).items():
        full = prefix + path
        commit, dirty = moved.get(full, (recorded_commit, False))
        if dirty:
            raise Refusal(f"run {run_id}: its submodule {full} had uncommitted changes, which its record cannot hold "
                          f"(the patch keeps only '{commit[:12]}...-dirty'): commit them in {full}, and that commit "
                          "in the project, then train again")
        if not (source / path / ".git").exists():
            raise Refusal(f"run {run_id}: its submodule {full} is not checked out in {source}: run `git submodule "
                          "update --init --recursive` there, then reproduce again")
        target = checkout / path
        shutil.rmtree(target, ignore_errors=True)
        for args, cwd in ((["clone", "--quiet", "--shared", "--no-checkout", str(source / path), str(target)], source),
                          (["checkout", "--quiet", "--detach", commit], target)):
            done = subprocess.run([*git, *args], cwd=cwd, capture_output=True, text=True)
            if done.returncode:
                raise Refusal(f"run {run_id}: its submodule {full} at {commit[:12]} cannot be checked out from "
                              f"{source / path} ({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else args[0]}): "
                              "fetch that commit there")
        check_out_submodules(source / path, target, git, moved, run_id, prefix=full + "/")


def place_data(recorded: Recorded, workspace: Path, checkout: Path, env: dict[str, str],
               echo: Callable[[str], None]) -> None:
    """The prepared data the run read: the workspace's when its digest matches the record's, else
    prepared afresh in the checkout by the recorded code and params (from MNIST_SOURCE, as
    `mnist-pipeline prepare` reads it); a mismatch then shows in the verdict."""
    source, target = workspace / PREPARED, checkout / PREPARED
    if source.is_dir() and record.files_digest(source) == recorded.tags.get("data_sha256"):
        shutil.copytree(source, target)
        return
    echo(f"reproduce: {source} is not the data run {recorded.run_id} read; preparing it again")
    _run([sys.executable, "-m", "stages", "prepare"], checkout, env, "prepare")


def _run(command: list[str], cwd: Path, env: dict[str, str], what: str, cpus: set[int] | None = None) -> None:
    """A stage of the reproduction (`what`), waited for; a stop signal meanwhile stops it, then this.
    `cpus`: the cores it may use, inherited from this thread's (set for the start alone)."""
    global _child, _launching
    before = os.sched_getaffinity(0) if cpus is not None else None
    _launching = True
    try:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        child = subprocess.Popen(command, cwd=cwd, env=env)
        _child = child
    finally:
        _launching = False
        if before is not None:
            os.sched_setaffinity(0, before)
    try:
        for signum in list(_passed):  # arrived while it was starting
            child.send_signal(signum)
        returncode = child.wait()  # a stop signal meanwhile is passed on (_on_stop); the wait goes on
    finally:
        _child = None
    if _passed:
        raise Stopped(_passed[0], during=what)
    if returncode:
        raise PipelineError(f"the reproduction's {what} failed (exit code {returncode}); its output is above")


def child_env(uri: str, checkout: Path, recorded: Recorded) -> dict[str, str]:
    """The environment the reproduction's stages run in: the same store, the checkout's code (a
    commit older than stages/entry.py does not choose it itself), as many GPUs as the run had, and
    nothing of DVC's (this is no stage of it)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DVC_")}
    env.update(MLFLOW_TRACKING_URI=uri, PYTHONPATH=str(checkout), **visible_devices(recorded),
               **{record.REPRODUCES_ENV: recorded.run_id})
    if recorded.tags.get("device_type") == "cpu" and recorded.tags.get("cpu_threads"):
        env["OMP_NUM_THREADS"] = recorded.tags["cpu_threads"]  # the run's split of each op (DDP sets its own)
    return env


def usable_cpus(recorded: Recorded, echo: Callable[[str], None]) -> set[int] | None:
    """The CPUs the training may use: as many as the run could (DDP splits them between its ranks),
    where this process may use more; None to leave them. Fewer is said: its floats may differ."""
    from pipeline.parallel import available_cpus

    wanted = recorded.tags.get("usable_cpus")
    if recorded.tags.get("device_type") != "cpu" or not (wanted or "").isdigit() or not hasattr(os, "sched_getaffinity"):
        return None
    have = available_cpus()
    if int(wanted) > have:
        echo(f"reproduce: run {recorded.run_id} could use {wanted} CPUs, this process {have}: its threads, and "
             "so its floats, may differ")
        return None
    return set(sorted(os.sched_getaffinity(0))[:int(wanted)]) if int(wanted) < have else None


def scratch_parent(workspace: Path) -> Path | None:
    """Where the checkout goes: DVC's scratch folder in the repository (git ignores it), which is
    where the workspace is, so a Slurm job's nodes see it as they see the workspace (a node's own
    /tmp they would not); else the system's temp folder."""
    folder = workspace / ".dvc" / "tmp"
    return folder if folder.is_dir() else None


def weights_difference(original: dict, remade: dict) -> str:
    """Where two state_dicts differ: the first tensor in name order, and the largest |Δw|."""
    if original.keys() != remade.keys():
        only = sorted(original.keys() ^ remade.keys())
        return f"the tensors differ by name ({only[0]} is in one only)"
    first, largest = None, 0.0
    for name in sorted(original):
        a, b = original[name], remade[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{name} is {b.dtype} {tuple(b.shape)}, was {a.dtype} {tuple(a.shape)}"
        if record.weights_digest({name: a}) != record.weights_digest({name: b}):  # bits, not values (-0.0, NaN)
            first = first or name
            largest = max(largest, (a.double() - b.double()).abs().max().item())
    return f"largest |Δw| {largest:.3g}, first in {first}" if first else "the same weights"


def facts_that_differ(original: dict[str, str], remade: dict[str, str]) -> list[str]:
    return [f"{key} {original.get(key, '-')} -> {remade.get(key, '-')}" for key in COMPARED
            if original.get(key) != remade.get(key)]


def reproduce(run_id: str, workspace: Path, echo: Callable[[str], None]) -> tuple[int, str]:
    """Re-make run `run_id`: (exit code, verdict line). torch is imported only once the run is one
    that can be re-made: a refusal answers in the time MLflow's import takes."""
    uri = tracking_uri()
    try:
        check_store(uri)
    except PipelineError as exc:
        raise Refusal(str(exc)) from None
    with store_errors(uri, f"reading run {run_id}"):
        store = RunStore(uri)
        recorded = read_record(store, run_id)
    check_host(recorded, workspace)
    # A worker still writing when Ctrl-C ended this must not turn the cleanup into a traceback.
    with tempfile.TemporaryDirectory(prefix="reproduce-", dir=scratch_parent(workspace),
                                     ignore_cleanup_errors=True) as tmp:
        with store_errors(uri, f"reading run {run_id}'s model"):
            original = logged_weights(run_id, Path(tmp) / "original", uri)
        checkout = prepare_checkout(recorded, workspace, Path(tmp))
        env = child_env(uri, checkout, recorded)
        place_data(recorded, workspace, checkout, env, echo)
        echo(f"reproduce: training {recorded.mode} as run {run_id} did, in {checkout} "
             f"(commit {recorded.tags['git_commit'][:12]}{', with its patch' if recorded.patch else ''})")
        _run([sys.executable, "-m", "stages", "train", "--mode", recorded.mode], checkout, env, "training",
             usable_cpus(recorded, echo))
        out = checkout / "models" / recorded.mode
        new_id = json.loads((out / "mlflow_run.json").read_text())["parent"]
        import torch

        remade_weights = torch.load(out / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    expected = recorded.tags.get("weights_sha256") or record.weights_digest(original)
    same = record.weights_digest(remade_weights) == expected
    remade_tags = store.run(new_id).tags
    if same:
        code, line = 0, f"{BIT_FOR_BIT}: run {new_id} made the same weights as run {run_id}"
    else:
        differs = facts_that_differ(recorded.tags, remade_tags)
        code, line = DIFFERS, (f"differs: run {new_id} against run {run_id}: "
                               f"{weights_difference(original, remade_weights)}; "
                               + ("in the record: " + ", ".join(differs) if differs else
                                  "nothing in the record differs"))
    verdict = "bit for bit" if same else "differs"
    with store_errors(uri, f"tagging run {run_id}"):
        store.set_tags(run_id, {"reproduction": verdict, "reproduction_run": new_id})
        store.set_tags(new_id, {"reproduces": run_id,
                                "mlflow.note.content": f"A reproduction of run {run_id}: {verdict}. {line}"})
    return code, line
