"""What a run needs to be re-made, and to be checked when it is: the code that ran and its
uncommitted change, digests of what it read, the software and hardware it ran on, and a digest of
the weights it made. Every mode's MLflow runs carry these as tags (`record_tags`); `mnist-pipeline
reproduce` reads them back.

Digests are SHA-256, in hex. Each is taken over content in a fixed order with names, never over a
file whose bytes carry more than the content (a pickle's memo, a zip's timestamps): the weights'
digest is over each tensor's name, dtype, shape and bytes, so the same weights saved twice match.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Iterable, Mapping

from pipeline.errors import PipelineError

PATCH_FOLDER, PATCH_FILE = "source", "uncommitted.patch"
PATCH_ARTIFACT = f"{PATCH_FOLDER}/{PATCH_FILE}"  # where a dirty tree's change goes on the parent run
REQUIREMENTS_LOCK = "requirements.lock"  # in the project's folder
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")  # the NVIDIA kernel module's (in a container too)
IMAGE_FACTS = Path("/etc/mnist-pipeline/image.json")  # written by the Dockerfile's last step


# Set for the training a reproduction starts (pipeline.reproduce): its runs carry the `reproduces`
# tag from their start (a stopped one is told from an ordinary training), and it registers no model
# (the registry's aliases stay on the models they serve).
REPRODUCES_ENV = "MNIST_PIPELINE_REPRODUCES"


def sha256(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))  # framed: ("ab", "c") is not ("a", "bc")
        digest.update(part)
    return digest.hexdigest()


# The project's own code: a run records these folders' Python files (code_sha256), and a training
# refuses to go on, or to be recorded, when one changed since it started. `workloads` holds a
# project's own workloads (pipeline/workloads says how they are named); a project may lack it.
CODE_PACKAGES = ("pipeline", "stages", "workloads")


def code_folders() -> list[Path]:
    """The `pipeline` and `stages` packages this process imports (stages/entry.py chose them), and
    the project's `workloads` folder beside them when there is one; found, not imported: nothing
    here reaches up into `stages`."""
    import importlib.util

    packages = [Path(importlib.util.find_spec(package).origin).parent for package in ("pipeline", "stages")]
    own = packages[0].parent / "workloads"
    return packages + ([own] if own.is_dir() else [])


def code_folders_in(root: Path) -> list[Path]:
    """The code folders of the project at `root` (a checkout being re-made, a test's copy)."""
    return [root / name for name in CODE_PACKAGES if name != "workloads" or (root / name).is_dir()]


def project_folder() -> Path:
    """The project whose code runs: the folder that holds the `pipeline` package."""
    return code_folders()[0].parent


def code_files(folders: Iterable[Path] | None = None) -> list[tuple[str, Path]]:
    """The project's Python files: (path within its package's parent, path), in order."""
    files = []
    for folder in folders if folders is not None else code_folders():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" not in path.parts and path.is_file():  # not an editor's lock file (a dangling link)
                files.append((str(path.relative_to(folder.parent)), path))
    return files


def code_digest(folders: Iterable[Path] | None = None) -> str:
    """The project's Python code, as the files are now: each file's path within its package's
    parent, and its bytes."""
    parts = []
    for name, path in code_files(folders):
        parts += [name.encode(), path.read_bytes()]
    return sha256(*parts)


def code_file_digests(folders: Iterable[Path] | None = None) -> dict[str, str]:
    """Each Python file's sha256, by its path within its package's parent: what changed, by name."""
    return {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in code_files(folders)}


def changed_since_import() -> list[Path]:
    """The project's code files (CODE_PACKAGES) whose bytes on disk are no longer those this process
    (or the fork server it came from) imported: edited, or gone."""
    import pipeline

    return [Path(origin) for origin, imported in pipeline.IMPORTED_SOURCES.items()
            if file_digest(Path(origin)) != imported]


def check_code_as_imported() -> None:
    """Refuse to record code that did not run: a file saved between this process's imports and
    the record (a fork server imports before its workers start) would be named as what trained."""
    changed = changed_since_import()
    if changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        first = changed[0]
        shown = first.relative_to(project_folder()) if first.is_relative_to(project_folder()) else first
        raise PipelineError(f"{shown} changed on disk after this training "
                            f"imported it{more}: its record would name code that did not train; train again")


def params_digest(params: Mapping[str, Any]) -> str:
    """The params a run logged, as MLflow holds them (text), in key order: the run's params page
    gives the same digest."""
    return sha256(json.dumps({key: str(value) for key, value in params.items()}, sort_keys=True).encode())


def files_digest(folder: Path) -> str:
    """Every file in `folder` (the prepared data): names and bytes."""
    parts = []
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        parts += [str(path.relative_to(folder)).encode(), path.read_bytes()]
    return sha256(*parts)


def file_digest(path: Path) -> str:
    """One file's bytes, as `sha256sum` prints it; "none" without the file."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "none"


def weights_digest(state_dict: Mapping[str, Any]) -> str:
    """The tensors of a state_dict, in name order: name, dtype, shape and raw bytes each."""
    parts = []
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        parts += [name.encode(), str(tensor.dtype).encode(), repr(tuple(tensor.shape)).encode(), _raw_bytes(tensor)]
    return sha256(*parts)


def _raw_bytes(tensor) -> bytes:
    import torch

    # Through uint8: numpy has no bfloat16, and a reinterpretation copies nothing it changes.
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def saved_weights_digest(path: Path) -> str:
    """The weights' digest of a mode's model.pt (read without unpickling anything)."""
    import torch

    return weights_digest(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])


def git(*args: str, cwd: Path | None = None) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


# Settings under which git neither converts line ends nor "fixes" whitespace: the working tree's
# bytes are what a patch records and what a checkout plus that patch gives back.
BYTE_EXACT_GIT = ["-c", "core.autocrlf=false", "-c", "core.safecrlf=false", "-c", "apply.whitespace=nowarn"]
# Whatever the user's git config says: a patch `git apply` takes as it is (prefixes a/ and b/, no
# textconv or external diff, no colour, the whole tree however deep the working directory), with
# each submodule as its "Subproject commit" lines, however a config or .gitmodules would hide it.
PATCH_COMMAND = ["git", *BYTE_EXACT_GIT, "-c", "diff.noprefix=false", "-c", "diff.relative=false", "diff", "HEAD",
                 "--binary", "--no-textconv", "--no-ext-diff", "--no-color", "--src-prefix=a/", "--dst-prefix=b/",
                 "--submodule=short", "--ignore-submodules=none"]


def uncommitted_patch(cwd: Path | None = None) -> bytes:
    """The change of the tracked files against the commit, as bytes (a file in another encoding,
    CRLF line ends: as they are): what `git apply` re-makes. Empty on a clean tree or outside git.
    Untracked files are not in it: the code digest tells them apart."""
    try:
        return subprocess.run(PATCH_COMMAND, cwd=cwd, capture_output=True, check=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):  # x86; Arm's kernels say Model
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The version in the kernel module's first line, as both kinds of module word it:
#   NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023
#   NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (...)
DRIVER_VERSION = re.compile(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s")


def driver_version(path: Path = DRIVER_VERSION_FILE) -> str:
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    found = DRIVER_VERSION.search(text.splitlines()[0] + " " if text else "")
    return found.group(1) if found else "unknown"


def image() -> dict[str, str]:
    """In the project's image: what it was built from (base image by digest, source commit, lock)."""
    try:
        facts = json.loads(IMAGE_FACTS.read_text())
    except (OSError, ValueError):
        return {}
    return {f"image_{key}": str(value) for key, value in facts.items()} if isinstance(facts, dict) else {}


def software() -> dict[str, str]:
    """The versions a result depends on, and the image it ran in; none of these calls initialises a GPU."""
    import torch

    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))  # ncclGetVersion: no CUDA call
    except (AttributeError, RuntimeError, TypeError):  # a torch built without NCCL
        nccl = "none"
    # The library's own cudnnGetVersion, not torch.backends.cudnn.version(): that one checks the
    # GPUs' compute capability first, which initialises CUDA, and raises on a version mismatch.
    library = getattr(torch._C, "_cudnn", None)
    try:
        cudnn = str(library.getVersionInt()) if library is not None else "none"
    except (AttributeError, RuntimeError):
        cudnn = "unknown"
    return {"python_version": platform.python_version(), "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda or "none", "cudnn_version": cudnn,
            "nccl_version": nccl, "cpu_model": cpu_model(), **image()}


def nccl_environment(environ: Mapping[str, str] = os.environ) -> str:
    """NCCL's settings from the environment, "K=V; ..." or "none". Each may change its algorithm,
    protocol, channels or transport, and so how a sum rounds (NCCL_ALGO, NCCL_PROTO, NCCL_P2P_LEVEL,
    ...); its log settings (NCCL_DEBUG*) cannot. The topology NCCL then picks is only in its log."""
    return "; ".join(f"{key}={value}" for key, value in sorted(environ.items())
                     if key.startswith("NCCL_") and not key.startswith("NCCL_DEBUG")) or "none"


def gpus() -> dict[str, str]:
    """On a CUDA device: the driver, the visible GPUs' names (CUDA is initialised by then) and
    NCCL's settings (DDP's all-reduce, and DataParallel's broadcast and reduce, run on NCCL)."""
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"gpu_names": ", ".join(names), "driver_version": driver_version(), "nccl_env": nccl_environment()}


def inputs(params: Mapping[str, Any], data_dir: Path) -> dict[str, str]:
    """The digests of what a training read, as tags on each of its runs (the software and the
    hardware are in stages.workers.run_facts; the commit and the patch in pipeline.tracking.facts)."""
    code = code_digest()
    check_code_as_imported()  # after the digest: an edit before it is caught here too
    return {"code_sha256": code, "params_sha256": params_digest(params),
            "requirements_lock_sha256": file_digest(project_folder() / REQUIREMENTS_LOCK), "data_sha256": files_digest(data_dir)}
