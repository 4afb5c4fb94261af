"""Sharded checkpoints (`train.checkpoint_format: sharded`): each rank writes its own part of the
model and optimizer state with torch.distributed.checkpoint, nothing is gathered to rank 0.

A whole checkpoint gathers fsdp's shards (and the optimizer state) to rank 0 and writes one file:
its memory and its write grow with the model. Here every rank writes and reads its part in a
folder all of them share: the parts of one checkpoint go to `checkpoint-shards/<tag>/`, then rank 0
writes `checkpoint.pt` (the schedule, the history, each rank's part of the epoch, and the tag,
without the weights), so a crash between the two leaves the previous checkpoint whole; parts no
checkpoint names are removed after. The training's last checkpoint is whole again (the weights are
gathered for model.pt then anyway): the MLflow run's and DVC's copy load anywhere.

The folder must be one every rank sees: one node, or a filesystem the nodes share. Node-local disks
(whose resume sends rank 0's file to every rank, pipeline.checkpoint.resume_state) cannot hold it:
`check_shared` finds that at the start, before any step."""

from __future__ import annotations

import shutil
import socket
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from torch import nn

from pipeline.errors import PipelineError
from pipeline.parallel import Rank, all_gather_objects, broadcast_object

SHARDS_DIR = "checkpoint-shards"
TAG_KEY = "shards"  # in checkpoint.pt: the folder under SHARDS_DIR that holds its weights and optimizer state


def tag(epochs_done: int, step: int) -> str:
    return f"epoch-{epochs_done}-step-{step}"


def save(out_dir: Path, name: str, model: nn.Module, optimizer, rank: Rank) -> None:
    """Every rank writes its part of the model's and the optimizer's state (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optimizer_state = get_state_dict(model, optimizer)
    folder = out_dir / SHARDS_DIR / name
    if rank.is_main:  # a crashed write of the same step, before its checkpoint.pt named it (no rank
        shutil.rmtree(folder, ignore_errors=True)  # writes before rank 0 has joined the save's first collective)
    with one_process_quiet():
        dcp.save({"model": weights, "optimizer": optimizer_state}, checkpoint_id=folder)


def load(out_dir: Path, state: dict[str, Any], model: nn.Module, optimizer) -> None:
    """Every rank reads its part of the checkpoint `state` names into the model and the optimizer,
    which are wrapped (and sharded) as they were when it was written (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = out_dir / SHARDS_DIR / state[TAG_KEY]
    if not (folder / ".metadata").is_file():
        raise PipelineError(f"{out_dir / 'checkpoint.pt'} names the sharded checkpoint {folder}, which is not there "
                            "(or not whole): restore it, or delete checkpoint.pt and train afresh")
    weights, optimizer_state = get_state_dict(model, optimizer)  # the shapes and shards to read into
    parts = {"model": weights, "optimizer": optimizer_state}
    with one_process_quiet():
        dcp.load(parts, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=parts["model"], optim_state_dict=parts["optimizer"])


@contextmanager
def one_process_quiet() -> Iterator[None]:
    """Without a process group (single, dp) torch.distributed.checkpoint reads and writes in this
    process alone, as meant, and warns that it assumes so on every checkpoint: not said."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


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


def check_shared(out_dir: Path, rank: Rank) -> None:
    """Every rank sees the file rank 0 writes in `out_dir`, else one line naming the first rank that
    does not, on every rank (a collective)."""
    if rank.world_size == 1:
        return
    # Each rank looks in its own out_dir (the same path on every node) for the name rank 0 wrote there.
    name = broadcast_object(f".shared-{uuid.uuid4().hex}" if rank.is_main else None, rank)
    if rank.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text("written by rank 0\n")
    broadcast_object(None, rank)  # written before any rank looks
    seen = all_gather_objects(((out_dir / name).is_file(), socket.gethostname(), str(out_dir)), rank)
    if rank.is_main:
        (out_dir / name).unlink(missing_ok=True)
    blind = [(r, host, folder) for r, (found, host, folder) in enumerate(seen) if not found]
    if blind:
        r, host, folder = blind[0]
        raise PipelineError(
            f"train.checkpoint_format: sharded needs a folder every rank shares, and rank {r} (on {host}) does not see "
            f"{folder} as rank 0 writes it (node-local disks?): put the project on a filesystem the nodes share, "
            "or set train.checkpoint_format: whole")

