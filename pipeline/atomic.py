"""Write outputs so that a crash never leaves a half-written file for DVC to cache.

Every writer goes to a temporary sibling first and renames it into place: a rename within one
file system is atomic, so readers see the old output or the new one, never a mix.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from pipeline.errors import PipelineError


def writable_folder(folder: str | Path) -> Path:
    """`folder`, made if need be; an error naming it unless files can be written there (a stage
    checks its output folders before it works, not after)."""
    folder = Path(folder)
    in_the_way(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            if os.statvfs(folder).f_flag & os.ST_RDONLY:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as exc:
        raise PipelineError(
            f"{folder}: cannot write into it ({exc.strerror}); run from a folder you can write to, "
            "or fix its permissions"
        ) from None
    return folder


def in_the_way(folder: str | Path) -> None:
    """An error naming the file that stands where `folder` (or a folder above it) goes: a folder
    cannot be made there, whatever its permissions."""
    folder = Path(folder)
    for path in (folder, *folder.parents):
        if path.is_dir():
            return
        # Looked at again: another process (a DDP rank making its log folder) may have made the
        # folder since the first look.
        if (path.exists() or path.is_symlink()) and not path.is_dir():
            raise PipelineError(f"{folder}: a file is in the way ({path} is not a folder); move it away, then run "
                                "again")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_failed(path: Path, reason: str, left: str | None = None) -> PipelineError:
    """The error for an output that could not be written: which file, why, and what is left (by
    default: judged by whether `path` is there)."""
    try:
        free = f"; {shutil.disk_usage(path.parent).free / 2**20:,.0f} MiB free there"
    except OSError:
        free = ""
    if left is None:
        left = f"the previous {path.name} is intact" if path.exists() else "nothing was left behind"
    return PipelineError(f"{path}: could not be written ({reason}{free}); {left}. Free disk space or fix "
                         "the folder's permissions, then run again")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on error it vanishes
    and `path` keeps what it held."""
    path = Path(path)
    writable_folder(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise write_failed(path, exc.strerror) from None
    os.close(fd)
    tmp = Path(tmp)
    # mkstemp creates 0600; outputs get the permissions a plain open() would have given them.
    os.chmod(tmp, 0o666 & ~_umask())
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, most often
        raise write_failed(path, exc.strerror or str(exc)) from None
    finally:
        tmp.unlink(missing_ok=True)


# In every folder a stage replaces whole: the mark that it is the pipeline's to replace.
MADE_HERE = ".made-by-mnist-pipeline"


def check_replaceable(path: Path, contents: Iterable[str]) -> None:
    """Refuse to replace a folder the pipeline did not make: `--out ~/Documents` must not delete
    a user's files. Ours are marked; one from before the mark holds nothing but `contents`."""
    if not path.is_dir():
        if path.exists():
            raise PipelineError(f"{path}: is a file, not a folder; choose another --out")
        return
    entries = {entry.name for entry in path.iterdir()}
    if not entries or MADE_HERE in entries or entries <= set(contents):
        return
    others = sorted(entries - set(contents))
    raise PipelineError(
        f"{path}: already holds files this stage did not write ({', '.join(others[:3])}"
        f"{', ...' if len(others) > 3 else ''}), and writing there would replace the whole folder; "
        "choose an empty or new folder for --out, or move those files away")


@contextmanager
def atomic_dir(path: str | Path, contents: Iterable[str]) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces the folder `path` once the block succeeds.
    `contents`: the names the block writes, so that a folder holding anything else is refused
    before any work (check_replaceable)."""
    path = Path(path)
    check_replaceable(path, contents)
    writable_folder(path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700
    try:
        yield tmp
        (tmp / MADE_HERE).write_text("This folder is an output of mnist-pipeline: a rerun replaces it whole.\n")
        # A folder cannot be swapped in one rename, so the old one is moved aside first: a crash
        # between the two renames leaves the new folder complete beside the old one, not a mix.
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_json(path: str | Path, fix: str) -> Any:
    """What write_json wrote, read back; a damaged file is an error naming it, where it breaks,
    and `fix` (what to do)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError as exc:
        raise PipelineError(f"{path}: not a text file ({exc.reason}); {fix}") from None
    except json.JSONDecodeError as exc:
        raise PipelineError(f"{path}: damaged, not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                            f"{fix}") from None


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def portable(obj: Any) -> Any:
    """`obj` with every tensor on the CPU and contiguous: a file written on a GPU, or from
    channels_last weights, then loads anywhere, in the standard layout, with weights_only=True."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().contiguous()
    if isinstance(obj, dict):
        copy = type(obj)((key, portable(value)) for key, value in obj.items())
        if hasattr(obj, "_metadata"):  # a state_dict's per-module versions, which load_state_dict reads
            copy._metadata = obj._metadata
        return copy
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(value) for value in obj)
    return obj


def save_torch(path: str | Path, obj: Any) -> None:
    """torch.save of `obj` made portable: loadable on any machine with torch.load(weights_only=True)."""
    import torch

    with atomic_path(path) as tmp:
        try:
            torch.save(portable(obj), tmp)
        except RuntimeError as exc:  # torch's writer reports a full disk as "unexpected pos ..."
            raise write_failed(Path(path), f"torch.save failed: {str(exc).splitlines()[0]}") from None
