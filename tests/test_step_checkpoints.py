"""Checkpoints every N steps (`train.checkpoint_every_steps`, #56): a training killed mid-epoch
goes on from the next step and ends with the uninterrupted training's weights and epoch metrics,
bit for bit, on one device and on 3 DDP or FSDP ranks (gloo), with dropout drawing from restored random
states. The trainings are the pipeline's own loop in processes of their own, killed by its crash
hook right after a step's checkpoint (tests/ddp_harness.py); the stage's path, torchrun's restart
included, is tests/test_train_modes.py's odd-world-size resume."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.checkpoint import CHECKPOINT_FILE, in_epoch_step, other_world, read_checkpoint, resume_state, trajectory
from pipeline.config import TrainConfig
from pipeline.errors import PipelineError
from pipeline.loop import Training, build, in_epoch_part, train
from pipeline.parallel import Rank
from tests.ddp_harness import CLASSIC, learnable_data, rank_dir, run_ranks, train_config

# 400 images in batches of 40: 10 steps an epoch, 20 in all. Checkpoints at global steps 4, 8, 12
# and 16 (10 and 20 end epochs); killed after 16, the 6th step of epoch 2, in its dropout's stream.
EVERY, KILLED_AFTER = 4, 16
# Metrics that depend on the samples and weights alone, not on the clock.
EXACT = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "clipped_steps", "loss_windows",
         "lr_at_epoch_end", "rank_weight_checksums")


def config():
    # classic: dropout, so the resumed steps must draw what the uninterrupted ones drew.
    return dataclasses.replace(train_config(batch_size=40, epochs=2), checkpoint_every_steps=EVERY)


def data():
    return learnable_data(400), learnable_data(50, seed=1)


def trainer(r: int, world: int, out, phases: tuple[str, ...], mode: str) -> None:
    """One rank of one or more attempts, in turn: 'whole' trains uninterrupted, 'killed' dies after
    step KILLED_AFTER's checkpoint (so it comes last), 'resumed' goes on from the checkpoint rank 0
    wrote."""
    for phase in phases:
        folder = rank_dir(out / phase.replace("killed", "resumed"), r)
        if phase == "killed":
            os.environ["MNIST_PIPELINE_CRASH_AFTER_STEP"] = str(KILLED_AFTER)
        state = read_checkpoint(out / "resumed" / "rank-0" / CHECKPOINT_FILE) if phase == "resumed" else None
        model, history = train(Training(config(), mode, Rank(r, r, world, world), torch.device("cpu"), folder,
                                        resume_state=state, workload=CLASSIC), *data())
        if r == 0:
            torch.save({"weights": model.state_dict(), "history": history}, out / f"{phase}.pt")


@pytest.mark.parametrize("world, mode", [(1, "single"), (3, "ddp"), (3, "fsdp")])
def test_a_training_killed_mid_epoch_resumes_bit_for_bit(tmp_path, world, mode):
    # The uninterrupted training runs first in the processes that are then killed: a start of
    # `world` processes fewer (each imports torch and the pipeline, most of their cost). The resume
    # still starts afresh, as after a real preemption.
    with pytest.raises(mp.ProcessExitedException, match="exit code 75"):
        run_ranks(world, trainer, tmp_path, ("whole", "killed"), mode)
    saved = read_checkpoint(tmp_path / "resumed" / "rank-0" / CHECKPOINT_FILE)
    assert (saved["epoch"], in_epoch_step(saved)) == (1, KILLED_AFTER - 10)
    assert saved["in_epoch"]["world_size"] == world and len(saved["in_epoch"]["ranks"]) == world
    run_ranks(world, trainer, tmp_path, ("resumed",), mode)

    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(whole["weights"].values(), resumed["weights"].values()))
    assert whole["weights"].keys() == resumed["weights"].keys()
    for before, after in zip(whole["history"], resumed["history"], strict=True):
        assert {key: after[key] for key in EXACT} == {key: before[key] for key in EXACT}
    assert resumed["history"][-1]["resumed_at_step"] == KILLED_AFTER - 10
    assert "resumed_at_step" not in resumed["history"][0] and "breakdown" not in resumed["history"][-1]
    # Its time holds the steps before the kill too, not just the 4 after it: more than what the
    # checkpoint carried (a bound that needs no second clock, so a noisy host cannot break it).
    carried = max(part["wall_s"] for part in saved["in_epoch"]["ranks"])
    assert carried > 0 and resumed["history"][-1]["train_time_s"] > carried


@pytest.mark.fast
def test_a_mid_epoch_checkpoint_resumes_only_at_its_world_size(tmp_path):
    state = {"epoch": 1, "in_epoch": {"world_size": 3, "ranks": [{"step": 6}, {"step": 6}, {"step": 6}]}}
    assert in_epoch_part(state, Rank(1, 1, 3, 3), tmp_path / CHECKPOINT_FILE) == {"step": 6}
    assert in_epoch_part({"epoch": 1}, Rank(), tmp_path / CHECKPOINT_FILE) is None  # an epoch's end: any size
    assert other_world(state, None, tmp_path / CHECKPOINT_FILE) is None  # a Slurm job decides: not known before
    refusal = (r"checkpoint.pt: written at step 6 of epoch 2 by 3 ranks, and this training would have 2: set "
               r"train.nproc \(and train.nodes\) back to make 3, or delete it and train afresh")
    with pytest.raises(PipelineError, match=refusal):
        in_epoch_part(state, Rank(0, 0, 2, 2), tmp_path / CHECKPOINT_FILE)
    # What `dvc repro` says when it would continue the training: it starts afresh instead, saying why.
    assert re.search(refusal, other_world(state, 2, tmp_path / CHECKPOINT_FILE))


@pytest.mark.fast
def test_a_restart_continues_only_a_checkpoint_of_its_own_launch(tmp_path):
    """A restarted worker (torchrun's restart, a requeued Slurm job) continues what its own launch
    saved; a checkpoint an earlier training left in the folder is not its to finish. --resume
    continues whatever is there."""
    cfg = TrainConfig()
    model, optimizer, scheduler = build(cfg, 10, torch.device("cpu"))
    path = tmp_path / CHECKPOINT_FILE
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "epoch": 1, "history": [], "trajectory": trajectory(cfg, "single"), "extra": {"launch": "job-7"}}, path)
    expected = trajectory(cfg, "single")
    assert resume_state(path, expected, asked=False, restarted=True, rank=Rank(), launch="job-7")["epoch"] == 1
    assert resume_state(path, expected, asked=False, restarted=True, rank=Rank(), launch="job-8") is None
    assert resume_state(path, expected, asked=True, restarted=False, rank=Rank(), launch="job-8")["epoch"] == 1
    assert resume_state(path, expected, asked=False, restarted=False, rank=Rank(), launch="job-7") is None
