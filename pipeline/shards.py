"""Sharded checkpoints (`train.checkpoint_format: sharded`, `sharded-async`): each rank writes its
own part of the model and optimizer state with torch.distributed.checkpoint, nothing is gathered
to rank 0; `Writer` writes a training's checkpoints in whichever format.

A whole checkpoint gathers fsdp's shards (and the optimizer state) to rank 0 and writes one file:
its memory and its write grow with the model. Here every rank writes and reads its part in a
folder all of them share: the parts of one checkpoint go to `checkpoint-shards/<tag>/`, then rank 0
writes `checkpoint.pt` (the schedule, the history, each rank's part of the epoch, and the tag,
without the weights), so a crash between the two leaves the previous checkpoint whole; parts no
checkpoint names are removed after. The training's last checkpoint is whole again (the weights are
gathered for model.pt then anyway): the MLflow run's and DVC's copy load anywhere.

`sharded-async` copies each rank's part in memory and writes it in a thread while the training
goes on (torch.distributed.checkpoint.async_save, over a gloo group of its own, so its collectives
never interleave with the training's): the step waits for the copy, not the disk. Rank 0 writes
checkpoint.pt once every part is on disk, so it never names a checkpoint that is not whole; the
next checkpoint, a preemption's stop and the training's end wait for the write in flight.

The folder must be one every rank sees: one node, or a filesystem the nodes share. Node-local disks
(whose resume sends rank 0's file to every rank, pipeline.checkpoint.resume_state) cannot hold it:
`check_shared` finds that at the start, before any step."""

from __future__ import annotations

import copy
import shutil
import socket
import threading
import traceback
import uuid
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch import nn

from pipeline.atomic import save_torch
from pipeline.errors import PipelineError
from pipeline.parallel import PROCESS_GROUP_TIMEOUT, Rank, all_gather_objects, broadcast_object

SHARDS_DIR = "checkpoint-shards"
TAG_KEY = "shards"  # in checkpoint.pt: the folder under SHARDS_DIR that holds its weights and optimizer state
RANKS_KEY = "shards_world_size"  # in checkpoint.pt: the ranks that wrote the parts
SHARDED = ("sharded", "sharded-async")  # the train.checkpoint_format values whose checkpoints are in parts


# Without a process group (single, dp) torch.distributed.checkpoint reads and writes in one process,
# as meant here, and warns that it assumes so on every checkpoint, from the writer's thread too.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def tag(epochs_done: int, step: int) -> str:
    return f"epoch-{epochs_done}-step-{step}"


class Writer:
    """A training's checkpoints, in train.checkpoint_format: `parts` on every rank (sharded: each
    writes its own), then `commit` on rank 0 (checkpoint.pt, once the parts are on disk)."""

    def __init__(self, out_dir: Path, rank: Rank, checkpoint_format: str) -> None:
        self.out_dir, self.rank = out_dir, rank
        self.sharded = checkpoint_format in SHARDED
        self.background = checkpoint_format == "sharded-async"
        self.pending: InFlight | None = None
        # Made on every rank, in the same order as the training's other groups (a collective).
        self.group = dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT) \
            if self.background and dist.is_initialized() else None

    def parts(self, name: str, model: nn.Module, optimizer) -> dict[str, Any]:
        """Every rank: its part of the model's and the optimizer's state, written now or (async)
        copied now and written in a thread; what checkpoint.pt says of them."""
        self.wait()  # one write in flight at most, in order
        upload = save(self.out_dir, name, model, optimizer, self.rank, self.group, self.background)
        if upload is not None:
            self.pending = InFlight(upload, self.out_dir / SHARDS_DIR / name)
        return {"model": None, "optimizer": None, TAG_KEY: name, RANKS_KEY: self.rank.world_size}

    def commit(self, path: Path, state: dict[str, Any]) -> None:
        """Rank 0: the checkpoint file, at once or (async) when the parts it names are all on disk."""
        if self.pending is None:
            write_checkpoint(path, state)
        else:
            kept = copy.deepcopy(state)  # as it is now: the training goes on changing its history
            self.pending.then(lambda: write_checkpoint(path, kept))

    def wait(self) -> None:
        """Every rank: the write in flight is on disk, and so is the file rank 0 writes to name it,
        before any rank goes on (or stops); or the first rank's error, one line on every rank."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        error = pending.wait()
        said = [None] * self.rank.world_size
        if self.group is not None:  # the ranks call wait() at the same points: one exchange each time
            dist.all_gather_object(said, one_line(error) if error else None, group=self.group)
        else:
            said = [one_line(error) if error else None]
        failed = next(((r, line) for r, line in enumerate(said) if line), None)
        if failed is not None:
            r, line = failed
            raise PipelineError(line if r == self.rank.rank else f"rank {r}: {line}")


class InFlight:
    """An asynchronous write, and what rank 0 does once it is done, with its error kept for `wait`."""

    def __init__(self, upload: Future, folder: Path) -> None:
        self.upload, self.folder, self.done, self.error = upload, folder, threading.Event(), None
        self.done.set()  # nothing to do after it yet

    def then(self, action: Callable[[], None]) -> None:
        self.done.clear()

        def run(upload: Future) -> None:  # in the writer's thread, or here if it is done already
            try:
                if upload.exception() is None:
                    action()
            except BaseException as exc:  # kept for wait(): a callback's exception would be lost
                self.error = exc
            finally:
                self.done.set()

        self.upload.add_done_callback(run)

    def wait(self) -> BaseException | None:
        """The write's error (or, on rank 0, the file's), once both are done; None if none."""
        try:
            with said_in_one_line(self.folder, "written"):
                self.upload.result()
        except Exception as exc:  # a peer gone mid-write: gloo's own error
            return exc if isinstance(exc, PipelineError) else PipelineError(
                f"{self.folder}: the sharded checkpoint could not be written ({one_line(exc)})")
        self.done.wait()
        return self.error


def write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Rank 0 writes the checkpoint, then removes the sharded parts it does not name (all of them
    when it is whole): a crash before it is written leaves the previous one as it was."""
    save_torch(path, state)
    prune(path.parent, state.get(TAG_KEY))


def save(out_dir: Path, name: str, model: nn.Module, optimizer, rank: Rank, group=None,
         background: bool = False) -> Future | None:
    """Every rank writes its part of the model's and the optimizer's state (a collective), or
    (`background`) copies it and returns the write's future. A tensor every rank holds alike is
    written by rank 0, as a whole checkpoint holds it: DDP's and fsdp's BatchNorm statistics
    differ by rank between the forwards that send rank 0's to the others, and torch's default
    would keep whichever rank's had written least."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optimizer_state = get_state_dict(model, optimizer)
    folder = out_dir / SHARDS_DIR / name
    if rank.is_main:  # a crashed write of the same step, before its checkpoint.pt named it (no rank
        shutil.rmtree(folder, ignore_errors=True)  # writes before rank 0 has joined the save's first collective)
    parts = {"model": weights, "optimizer": optimizer_state}
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    with said_in_one_line(folder, "written"):
        if background:  # the copy is made before it returns: the next step may change the weights
            # A storage writer that stages the copy itself: the thread then makes no CUDA call (by
            # default it reads ahead on the current stream, cuda:0 in a thread of its own).
            return dcp.async_save(parts, checkpoint_id=folder, storage_writer=dcp.FileSystemWriter(folder),
                                  process_group=group, planner=planner)
        dcp.save(parts, checkpoint_id=folder, planner=planner)
    return None


def load(out_dir: Path, state: dict[str, Any], model: nn.Module, optimizer) -> None:
    """Every rank reads its part of the checkpoint `state` names into the model and the optimizer,
    which are wrapped (and sharded) as they were when it was written (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    folder = out_dir / SHARDS_DIR / state[TAG_KEY]
    if not complete(folder):
        raise PipelineError(f"{out_dir / 'checkpoint.pt'} names the sharded checkpoint {folder}, which is not there "
                            "(or not whole): restore it, or delete checkpoint.pt and train afresh")
    # The shapes and shards to read into. Asked of a fresh optimizer, torch makes state for every
    # parameter (a step at lr 0); the checkpoint has none for a parameter that never had a gradient
    # (fp16's skipped steps, a frozen layer), and the optimizer gets none for it either.
    weights, optimizer_state = get_state_dict(model, optimizer)
    with said_in_one_line(folder, "read"):
        saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    optimizer_state["state"] = {name: values for name, values in optimizer_state["state"].items()
                                if any(key.startswith(f"optimizer.state.{name}.") for key in saved)}
    parts = {"model": weights, "optimizer": optimizer_state}
    with said_in_one_line(folder, "read"):
        dcp.load(parts, checkpoint_id=folder)
    set_model_state_dict(model, parts["model"])
    set_optimizer_state_dict(model, optimizer, parts["optimizer"], options=StateDictOptions(strict=False))


def complete(folder: Path) -> bool:
    """Whether a sharded checkpoint's folder is whole: torch.distributed.checkpoint writes its
    `.metadata` last, once every rank's part is written."""
    return (folder / ".metadata").is_file()


@contextmanager
def said_in_one_line(folder: Path, done: str) -> Iterator[None]:
    """torch.distributed.checkpoint's errors (a full disk, a missing part) as one line naming the
    folder: they derive from BaseException, past every `except Exception` (a traceback per rank)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        # Its failures: each rank's (exception, stack summary).
        first = next(iter(exc.failures.values()), None) if getattr(exc, "failures", None) else None
        error = first[0] if isinstance(first, tuple) else first if isinstance(first, BaseException) else exc
        raise PipelineError(f"{folder}: the sharded checkpoint could not be {done} ({one_line(error)})") from None


def one_line(error: BaseException) -> str:
    """An error as the last line Python would print for it (a PipelineError: its message)."""
    if isinstance(error, PipelineError):
        return str(error)
    return traceback.format_exception_only(type(error), error)[-1].strip()


def prune(out_dir: Path, kept: str | None) -> None:
    """Removes every sharded checkpoint but `kept` (rank 0, once checkpoint.pt names it)."""
    folder = out_dir / SHARDS_DIR
    if not folder.is_dir():
        return
    for old in folder.iterdir():
        if old.name != kept:
            shutil.rmtree(old, ignore_errors=True)
    if kept is None:
        shutil.rmtree(folder, ignore_errors=True)


def check_shared(out_dir: Path, rank: Rank, needed_by: str) -> None:
    """Every rank sees the file rank 0 writes in `out_dir`, else one line naming the first rank that
    does not, and `needed_by` (what needs a shared folder), on every rank (a collective)."""
    if rank.world_size == 1:
        return
    # Each rank looks in its own out_dir (the same path on every node) for the name rank 0 wrote there.
    name, failed = f".shared-{uuid.uuid4().hex}", None
    if rank.is_main:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / name).write_text("written by rank 0\n")
        except OSError as exc:  # said on every rank, not waited for by the others
            failed = f"{out_dir}: {exc.strerror or exc}"
    name, failed = broadcast_object((name, failed), rank)
    if failed:
        raise PipelineError(f"{needed_by}: rank 0 could not write in {failed}")
    seen = all_gather_objects(((out_dir / name).is_file(), socket.gethostname(), str(out_dir)), rank)
    if rank.is_main:
        (out_dir / name).unlink(missing_ok=True)
    blind = [(r, host, folder) for r, (found, host, folder) in enumerate(seen) if not found]
    if blind:
        r, host, folder = blind[0]
        raise PipelineError(
            f"{needed_by} needs a folder every rank shares, and rank {r} (on {host}) does not see {folder} as "
            "rank 0 writes it (node-local disks?): put the project on a filesystem the nodes share, or set "
            "train.checkpoint_format: whole")

