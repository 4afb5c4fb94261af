"""Per-epoch checkpoints (the loop writes them atomically), the check that a resume continues
the same run, and the record that tells an interrupted training from a finished one."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pipeline.config import TrainConfig, WorkloadConfig
from pipeline.errors import PipelineError
from pipeline.parallel import Rank, all_gather_objects, broadcast_object
from pipeline.record import code_file_digests, file_digest
from pipeline.shards import RANKS_KEY, SHARDS_DIR, TAG_KEY, complete as shards_complete
from pipeline.workloads import full_init_args
from pipeline.unfinished import UNFINISHED_FILE

CHECKPOINT_FILE = "checkpoint.pt"
MODEL_FILE = "model.pt"
# The settings that shape the trajectory: resuming under other values would not end where an
# uninterrupted run ends, so it is refused. (nproc may change: DDP sees the same global batches.
# bf16 changes every step's rounding; deterministic decides whether the bits repeat at all.)
# (grad_accum_steps sums each step's gradient in other parts: other rounding. fp16 rounds otherwise
# and skips the steps whose gradients overflowed.)
# The workload (its class and arguments: the model, the loss) shapes it too.
TRAJECTORY_KEYS = ("epochs", "batch_size", "optimizer", "schedule", "lr", "momentum", "weight_decay",
                   "max_grad_norm", "grad_accum_steps", "seed", "bf16", "fp16", "deterministic", "sync_batchnorm",
                   "fsdp_sharding", "compile")
# What a checkpoint saved before the optimizer, the schedule, clipping, accumulation, fp16 and
# SyncBatchNorm (and fsdp's sharding, whose reductions sum in another order, and torch.compile's
# kernels, which round otherwise) were settings trained with.
TRAJECTORY_BEFORE = {"optimizer": "adam", "schedule": "onecycle", "momentum": None, "max_grad_norm": 0.0,
                     "grad_accum_steps": 1, "fp16": False, "sync_batchnorm": False, "fsdp_sharding": "full",
                     "compile": False}


def trajectory(config: TrainConfig, mode: str, workload: WorkloadConfig | None = None) -> dict[str, Any]:
    """The settings a checkpoint must have been trained under to be continued; `workload` with every
    argument it is built with, its defaults filled in (None: the default workload)."""
    settings = asdict(config)
    if config.optimizer != "sgd":
        settings["momentum"] = None  # SGD's alone: a change under Adam changes nothing trained
    if mode != "ddp":
        settings["sync_batchnorm"] = False  # ddp's alone: single and dp normalise the whole batch anyway
    if mode != "fsdp":
        settings["fsdp_sharding"] = "full"  # fsdp's alone
    workload = workload or WorkloadConfig()
    return {"mode": mode, "workload": {"class_path": workload.class_path, "init_args": full_init_args(workload)},
            **{key: settings[key] for key in TRAJECTORY_KEYS}}


def _as_workload(saved: dict[str, Any]) -> dict[str, Any]:
    """A trajectory from before workloads were named: MNIST's, its model and label smoothing then
    train settings."""
    if "workload" in saved or "model" not in saved:
        return saved
    rest = {key: value for key, value in saved.items() if key not in ("model", "label_smoothing")}
    return {**rest, "workload": {"class_path": WorkloadConfig().class_path,
                                 "init_args": {"model": saved["model"], "label_smoothing": saved.get("label_smoothing")}}}


# What the loop saves each epoch: a file without them was written by other code.
CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "epoch", "history", "trajectory")


def read_checkpoint(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise PipelineError(f"{path}: unreadable checkpoint ({exc}); delete it and train from scratch") from None
    if not (isinstance(state, dict) and all(key in state for key in CHECKPOINT_KEYS)):
        raise PipelineError(f"{path}: not a checkpoint of this pipeline ({_described(state)}); move it away, then "
                            "train from scratch without --resume")
    return state


def _described(state: Any) -> str:
    """What a file that is not our checkpoint holds, in a few words."""
    if isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
        return f"a bare state_dict of {len(state)} tensors: weights only, no optimizer, schedule or epoch"
    if isinstance(state, dict):
        keys = ", ".join(map(str, list(state)[:5])) + (", ..." if len(state) > 5 else "")
        return f"a dict of {keys or 'nothing'}, without {', '.join(k for k in CHECKPOINT_KEYS if k not in state)}"
    return f"a {type(state).__name__}, not a dict"


def load_checkpoint(path: Path, expected: dict[str, Any]) -> dict[str, Any]:
    if not path.is_file():
        raise PipelineError(f"{path}: no checkpoint to resume from; train without --resume first")
    state = read_checkpoint(path)
    details = settings_changed(state, expected)
    if details:
        raise PipelineError(
            f"{path}: cannot resume, the settings changed since the checkpoint ({details}); "
            "restore them or train from scratch without --resume"
        )
    return state


def check_schedule_length(state: dict[str, Any], planned: int, path: Path) -> None:
    """A resumed schedule keeps the length it was saved with (its state holds it): one saved for
    another number of steps, the training set having changed size since, would climb back up
    past its end (cosine) or stop the training (one-cycle), so it is refused, in words."""
    schedule = state.get("scheduler") or {}
    saved = schedule.get("total_steps", schedule.get("T_max"))  # one-cycle's, cosine's; constant has none
    if saved is not None and saved != planned:
        raise PipelineError(f"{path}: cannot resume, its schedule spans {saved} steps and this training {planned} "
                            "(the training set changed size?): restore the data settings, or delete the "
                            "checkpoint and train afresh")


def settings_changed(state: dict[str, Any], expected: dict[str, Any]) -> str:
    """'key: saved -> now, ...' for each trajectory setting that differs; '' if none."""
    saved = {**TRAJECTORY_BEFORE, **_as_workload(state.get("trajectory", {}))}
    # A key this code does not know (a later version's setting) differs too: its training may not
    # be one this code can continue.
    return ", ".join(f"{k}: {saved.get(k)!r} -> {expected.get(k)!r}" for k in sorted(expected.keys() | saved.keys())
                     if saved.get(k) != expected.get(k))


def other_world(state: dict[str, Any], world_size: int | None, path: Path) -> str | None:
    """Why a mid-epoch checkpoint cannot go on at `world_size` ranks (each rank carries its own part
    of the epoch), nor a sharded one (each rank wrote its part of the weights), or None where it
    can, or the world size is not known before the job starts."""
    in_epoch = state.get("in_epoch")
    parts = state.get(RANKS_KEY)
    if parts and world_size is not None and parts != world_size:  # read back by as many (resharding: untested)
        return (f"{path}: its weights and optimizer state are in parts written by {parts} ranks "
                f"(a sharded checkpoint), and this training would have {world_size}: set train.nproc "
                f"(and train.nodes) back to make {parts}, or delete it and train afresh")
    if not in_epoch or world_size is None or in_epoch["world_size"] == world_size:
        return None
    return (f"{path}: written at step {in_epoch_step(state)} of epoch {state['epoch'] + 1} by {in_epoch['world_size']} "
            f"ranks, and this training would have {world_size}: set train.nproc (and train.nodes) back to make "
            f"{in_epoch['world_size']}, or delete it and train afresh")


def in_epoch_step(state: dict[str, Any]) -> int:
    """Steps done in the epoch after the checkpoint's last whole one (0: written at an epoch's end)."""
    in_epoch = state.get("in_epoch")
    return in_epoch["ranks"][0]["step"] if in_epoch else 0


def resume_state(path: Path, expected: dict[str, Any], asked: bool, restarted: bool, rank: Rank,
                 launch: str = "") -> dict[str, Any] | None:
    """The state to continue from, or None to start afresh, the same on every rank.

    Nodes have disks of their own, and only the node that held rank 0 wrote checkpoints; after a
    restart, rank 0 may be on another node. So every rank says which epoch its disk holds, and the
    lowest rank with the newest checkpoint reads it and sends it to all: a rank that decided by
    its own disk would start over while the others go on. Call it inside the process group, before
    wrapping for DDP. `asked`: --resume (no checkpoint anywhere is an error); `restarted`: torchrun
    restarted the workers, or Slurm requeued their job, so continue from a checkpoint that this
    `launch` (parallel.launch_id) wrote, if any node holds one: one an earlier training left there
    is not this one's to finish.
    """
    if not (asked or restarted):
        return None
    progress, problem = (-1, 0), None  # (epochs done, steps done in the next): how far a checkpoint is
    if path.is_file():
        try:
            state = load_checkpoint(path, expected)
            if asked or state.get("extra", {}).get("launch", "") == launch:  # "": none known, as in tests
                progress = (state["epoch"], in_epoch_step(state))
        except PipelineError as exc:
            problem = str(exc)
    found = all_gather_objects((progress, rank.rank, problem), rank)
    newest, source, _ = max(found, key=lambda item: (item[0], -item[1]))
    if newest[0] >= 0:
        return broadcast_object(state if rank.rank == source else None, rank, src=source)
    # Every rank raises the same error, so none waits on the others.
    problems = list(dict.fromkeys(problem for _, _, problem in found if problem))  # once per node
    if problems:  # a checkpoint is there but cannot be continued: never overwrite it silently
        raise PipelineError("; ".join(problems))
    if asked:
        raise PipelineError(f"{path}: no checkpoint to resume from on any node; train without --resume first")
    return None


def inputs_snapshot(data_dir: Path, code_dirs: list[Path]) -> dict[str, dict[str, str]]:
    """What decides a training besides its settings, file by file: the code (each Python file of
    the packages) and the prepared data. A training goes on, and its outputs are recorded, only if
    these are as they were when it started."""
    data = {f"{data_dir.name}/{path.name}": file_digest(path)
            for path in sorted(data_dir.iterdir()) if path.is_file()} if data_dir.is_dir() else {}
    return {"code": code_file_digests(code_dirs), "data": data}


def inputs_changed(then: Any, now: dict[str, dict[str, str]]) -> str | None:
    """The first input that differs between two snapshots, named ("pipeline/loop.py changed"), or None."""
    if not isinstance(then, dict) or set(then) != set(now) or not all(isinstance(v, dict) for v in then.values()):
        return "the code or the prepared data may have changed (recorded by an older version)"
    for kind in ("code", "data"):
        for name in sorted(then[kind].keys() | now[kind].keys()):
            if then[kind].get(name) != now[kind].get(name):
                how = "appeared" if name not in then[kind] else "was removed" if name not in now[kind] else "changed"
                return f"{name} {how}"
    return None


def why_not_continue(out_dir: Path, record: dict, expected: dict[str, Any], inputs: dict,
                     settings: dict[str, Any], world_size: int | None = None) -> str | None:
    """None if the interrupted training in `out_dir` can go on and end with the outputs an
    uninterrupted one would write; otherwise why not, for the log. `settings`: every setting the
    stage reads, as `record` (written at the start) holds them: the trajectory's alone would let
    a changed `train.nproc` or `tracking` setting take outputs made under the old ones."""
    path = out_dir / CHECKPOINT_FILE
    if not path.is_file():
        return "it ended before its first checkpoint"
    if "inputs" not in record or not isinstance(record.get("settings"), dict):
        return f"{out_dir / UNFINISHED_FILE} is unreadable, or from an older version"
    changed = inputs_changed(record["inputs"], inputs)
    if changed:
        return f"{changed} since it started"
    then = record["settings"]
    changed = [key for key in sorted(then.keys() | settings.keys()) if then.get(key) != settings.get(key)]
    if changed:
        return "its settings changed (" + ", ".join(
            f"{key}: {then.get(key)!r} -> {settings.get(key)!r}" for key in changed[:4]) + ")"
    try:
        state = read_checkpoint(path)
    except PipelineError as exc:
        return str(exc)
    details = settings_changed(state, expected)
    if details:
        return f"its settings changed ({details})"
    if state.get(TAG_KEY) and not shards_complete(out_dir / SHARDS_DIR / state[TAG_KEY]):
        return f"{out_dir / SHARDS_DIR / state[TAG_KEY]}, where its weights are, is gone or not whole"
    return other_world(state, world_size, path)
