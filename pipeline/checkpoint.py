"""Per-epoch checkpoints (the loop writes them atomically) and the check that a resume continues
the same run."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pipeline.config import TrainConfig
from pipeline.errors import PipelineError

CHECKPOINT_FILE = "checkpoint.pt"
MODEL_FILE = "model.pt"
# The settings that shape the trajectory: resuming under other values would not end where an
# uninterrupted run ends, so it is refused. (nproc may change: DDP sees the same global batches.)
TRAJECTORY_KEYS = ("model", "epochs", "batch_size", "lr", "weight_decay", "seed")


def trajectory(config: TrainConfig, mode: str) -> dict[str, Any]:
    settings = asdict(config)
    return {"mode": mode, **{key: settings[key] for key in TRAJECTORY_KEYS}}


def load_checkpoint(path: Path, expected: dict[str, Any]) -> dict[str, Any]:
    if not path.is_file():
        raise PipelineError(f"{path}: no checkpoint to resume from; train without --resume first")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise PipelineError(f"{path}: unreadable checkpoint ({exc}); delete it and train from scratch") from None
    saved = state.get("trajectory", {})
    changed = sorted(k for k in expected if saved.get(k) != expected[k])
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {expected[k]!r}" for k in changed)
        raise PipelineError(
            f"{path}: cannot resume, the settings changed since the checkpoint ({details}); "
            "restore them or train from scratch without --resume"
        )
    return state
