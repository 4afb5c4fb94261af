"""Checkpoints every N steps (`train.checkpoint_every_steps`, #56): a training killed mid-epoch
goes on from the next step and ends with the uninterrupted training's weights and epoch metrics,
bit for bit, on one device and on 3 DDP or FSDP ranks (gloo), with dropout drawing from restored random
states; with whole checkpoints (rank 0 writes one file, the ranks' disks their own) and with sharded
ones (`train.checkpoint_format: sharded`: each rank writes its part in a folder they share;
`sharded-async`: in a thread, while the training goes on). The trainings are the pipeline's own loop in processes of their own, killed by its crash
hook right after a step's checkpoint (tests/ddp_harness.py); the stage's path, torchrun's restart
included, is tests/test_train_modes.py's odd-world-size resume."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import torch.multiprocessing as mp

from pipeline import shards
from pipeline.checkpoint import (CHECKPOINT_FILE, in_epoch_step, inputs_snapshot, other_world, read_checkpoint, resume_state,
                                 trajectory, why_not_continue)
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


def config(checkpoints: str = "whole"):
    # classic: dropout, so the resumed steps must draw what the uninterrupted ones drew.
    return dataclasses.replace(train_config(batch_size=40, epochs=2), checkpoint_every_steps=EVERY,
                               checkpoint_format=checkpoints)


def data():
    return learnable_data(400), learnable_data(50, seed=1)


def folder_of(out, phase: str, r: int, checkpoints: str):
    """Where rank r of an attempt writes: its node's disk, or (sharded) the folder all ranks share."""
    folder = out / phase.replace("killed", "resumed")
    return rank_dir(folder, r) if checkpoints == "whole" else folder


def trainer(r: int, world: int, out, phases: tuple[str, ...], mode: str, checkpoints: str = "whole") -> None:
    """One rank of one or more attempts, in turn: 'whole' trains uninterrupted, 'killed' dies after
    step KILLED_AFTER's checkpoint (so it comes last), 'resumed' goes on from the checkpoint rank 0
    wrote."""
    for phase in phases:
        folder = folder_of(out, phase, r, checkpoints)
        folder.mkdir(parents=True, exist_ok=True)
        if phase == "killed":
            os.environ["MNIST_PIPELINE_CRASH_AFTER_STEP"] = str(KILLED_AFTER)
        state = read_checkpoint(folder_of(out, "resumed", 0, checkpoints) / CHECKPOINT_FILE) \
            if phase == "resumed" else None
        model, history = train(Training(config(checkpoints), mode, Rank(r, r, world, world), torch.device("cpu"),
                                        folder, resume_state=state, workload=CLASSIC), *data())
        if r == 0:
            torch.save({"weights": model.state_dict(), "history": history}, out / f"{phase}.pt")


# Sharded: ddp's parts written at once, fsdp's in a thread, and one device's (no process group) in a
# thread; fsdp's at once under hybrid sharding's mesh: tests/test_fsdp.py.
@pytest.mark.parametrize("world, mode, checkpoints", [(1, "single", "whole"), (3, "ddp", "whole"), (3, "fsdp", "whole"),
                                                      (3, "ddp", "sharded"), (1, "single", "sharded-async"),
                                                      (3, "fsdp", "sharded-async")])
def test_a_training_killed_mid_epoch_resumes_bit_for_bit(tmp_path, world, mode, checkpoints):
    # The uninterrupted training runs first in the processes that are then killed: a start of
    # `world` processes fewer (each imports torch and the pipeline, most of their cost). The resume
    # still starts afresh, as after a real preemption.
    with pytest.raises(mp.ProcessExitedException, match="exit code 75"):
        run_ranks(world, trainer, tmp_path, ("whole", "killed"), mode, checkpoints)
    folder = folder_of(tmp_path, "resumed", 0, checkpoints)
    saved = read_checkpoint(folder / CHECKPOINT_FILE)
    assert (saved["epoch"], in_epoch_step(saved)) == (1, KILLED_AFTER - 10)
    assert saved["in_epoch"]["world_size"] == world and len(saved["in_epoch"]["ranks"]) == world
    if checkpoints != "whole":  # no weights in the file: each rank's part in the folder it names, the older gone
        assert saved["model"] is None and saved["optimizer"] is None
        assert [path.name for path in (folder / shards.SHARDS_DIR).iterdir()] == [saved[shards.TAG_KEY]]
        parts = sorted(path.name for path in (folder / shards.SHARDS_DIR / saved[shards.TAG_KEY]).glob("*.distcp"))
        assert parts == [f"__{r}_0.distcp" for r in range(world)]
    run_ranks(world, trainer, tmp_path, ("resumed",), mode, checkpoints)
    # The training's last checkpoint is whole, whatever the format, and no part is left beside it.
    assert read_checkpoint(folder / CHECKPOINT_FILE)["model"] is not None
    assert not (folder / shards.SHARDS_DIR).exists()

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
    # Parts of the weights written by 3 ranks are read back by 3, even at an epoch's end.
    parts = {"epoch": 1, shards.TAG_KEY: shards.tag(1, 0), shards.RANKS_KEY: 3}
    assert other_world(parts, 3, tmp_path / CHECKPOINT_FILE) is None
    assert re.search(r"checkpoint.pt: its weights and optimizer state are in parts written by 3 ranks \(a sharded "
                     r"checkpoint\), and this training would have 2: set train.nproc \(and "
                     r"train.nodes\) back to make 3", other_world(parts, 2, tmp_path / CHECKPOINT_FILE))


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


def sharded_on_local_disks(r: int, world: int, out) -> None:
    train(Training(config("sharded"), "ddp", Rank(r, r, world, world), torch.device("cpu"), rank_dir(out, r),
                   workload=CLASSIC), *data())


def test_sharded_checkpoints_on_disks_the_ranks_do_not_share_are_refused_before_a_step(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match=r"train.checkpoint_format: sharded needs a folder every rank "
                       r"shares, and rank 1 \(on .+\) does not see .+rank-1 as rank 0 writes it"):
        run_ranks(2, sharded_on_local_disks, tmp_path)
    assert not list(tmp_path.rglob(CHECKPOINT_FILE)) and not list(tmp_path.rglob(".shared-*"))


@pytest.mark.fast
def test_a_sharded_checkpoint_reads_back_what_was_written_and_keeps_only_the_one_named(tmp_path):
    """pipeline.shards in one process (torch.distributed.checkpoint without a process group):
    weights and optimizer state as written, bit for bit; parts no checkpoint names removed; a
    checkpoint whose parts are gone is one line."""
    cfg = dataclasses.replace(TrainConfig(), checkpoint_format="sharded")
    model, optimizer, _ = build(cfg, 10, torch.device("cpu"))
    model(torch.rand(4, 1, 28, 28)).sum().backward()
    optimizer.step()
    shards.check_shared(tmp_path, Rank(), "train.checkpoint_format: sharded")  # one rank: nothing to check
    for name in ("old", shards.tag(1, 6)):
        shards.save(tmp_path, name, model, optimizer, rank=Rank())
    shards.prune(tmp_path, shards.tag(1, 6))
    assert [path.name for path in (tmp_path / shards.SHARDS_DIR).iterdir()] == ["epoch-1-step-6"]

    other, other_optimizer, _ = build(dataclasses.replace(cfg, seed=7), 10, torch.device("cpu"))
    shards.load(tmp_path, {shards.TAG_KEY: shards.tag(1, 6)}, other, other_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    saved, read = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert saved.keys() == read.keys() and all(torch.equal(saved[i][key], read[i][key])
                                               for i in saved for key in saved[i])
    with pytest.raises(PipelineError, match=r"names the sharded checkpoint .*epoch-2-step-1, which is not there"):
        shards.load(tmp_path, {shards.TAG_KEY: shards.tag(2, 1)}, other, other_optimizer)
    # A part gone: one line naming the folder (torch's error is a BaseException, a traceback per rank).
    next((tmp_path / shards.SHARDS_DIR / "epoch-1-step-6").glob("*.distcp")).unlink()
    with pytest.raises(PipelineError, match=r"epoch-1-step-6: the sharded checkpoint could not be read \(\w+Error: .+\)$") \
            as missing:
        shards.load(tmp_path, {shards.TAG_KEY: shards.tag(1, 6)}, other, other_optimizer)
    assert "\n" not in str(missing.value) and "FrameSummary" not in str(missing.value)
    shards.prune(tmp_path, None)  # a whole checkpoint names none
    assert not (tmp_path / shards.SHARDS_DIR).exists()


@pytest.mark.fast
def test_a_sharded_checkpoint_of_parameters_without_optimizer_state_reads_back_as_it_was(tmp_path):
    """A parameter the optimizer never stepped (fp16's skipped steps, a frozen layer) has no state
    in the checkpoint: the optimizer that reads it back has none for it either (torch makes state
    for every parameter of a fresh one, which its reader then misses)."""
    cfg = TrainConfig()
    model, optimizer, _ = build(cfg, 10, torch.device("cpu"))
    model(torch.rand(4, 1, 28, 28)).sum().backward()
    for parameter in list(model.parameters())[:-2]:  # only the last layer steps
        parameter.grad = None
    optimizer.step()
    shards.save(tmp_path, "partial", model, optimizer, rank=Rank())
    other, other_optimizer, _ = build(dataclasses.replace(cfg, seed=7), 10, torch.device("cpu"))
    shards.load(tmp_path, {shards.TAG_KEY: "partial"}, other, other_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    saved, read = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert len(saved) == 2 and saved.keys() == read.keys()
    assert all(torch.equal(saved[i][key], read[i][key]) for i in saved for key in saved[i])


@pytest.mark.fast
def test_an_asynchronous_checkpoint_is_named_only_once_its_parts_are_written_and_its_errors_are_raised(tmp_path):
    """shards.Writer in `sharded-async`: the file naming the parts is written when they are on disk
    (wait() returns after both), the parts of older checkpoints then removed, and an error in the
    file's write reaches wait() rather than the writer's thread."""
    cfg = dataclasses.replace(TrainConfig(), checkpoint_format="sharded-async")
    model, optimizer, _ = build(cfg, 10, torch.device("cpu"))
    writer = shards.Writer(tmp_path, Rank(), cfg.checkpoint_format)
    for step in (4, 8):
        writer.parts(shards.tag(0, step), model, optimizer)
        writer.commit(tmp_path / CHECKPOINT_FILE, {"step": step, shards.TAG_KEY: shards.tag(0, step)})
        copied = next(model.parameters()).detach().clone()
        with torch.no_grad():  # the next step changes the weights while the write may still run
            next(model.parameters()).add_(1.0)
    writer.wait()
    assert torch.load(tmp_path / CHECKPOINT_FILE, weights_only=True)["step"] == 8
    assert [path.name for path in (tmp_path / shards.SHARDS_DIR).iterdir()] == ["epoch-0-step-8"]
    written, written_optimizer, _ = build(dataclasses.replace(cfg, seed=3), 10, torch.device("cpu"))
    shards.load(tmp_path, {shards.TAG_KEY: shards.tag(0, 8)}, written, written_optimizer)
    assert torch.equal(next(written.parameters()), copied)  # as it was when copied, not as it is now
    assert not torch.equal(copied, next(model.parameters()))

    writer.parts(shards.tag(1, 0), model, optimizer)
    (tmp_path / "a-file").write_text("")  # no folder can be made there: the file's write fails
    writer.commit(tmp_path / "a-file" / CHECKPOINT_FILE, {shards.TAG_KEY: shards.tag(1, 0)})
    with pytest.raises(PipelineError, match="a-file"):
        writer.wait()


def failed_commit(r: int, world: int, out) -> None:
    """Both ranks write their parts in a thread; rank 0's file naming them cannot be written."""
    model, optimizer, _ = build(TrainConfig(), 10, torch.device("cpu"))
    writer = shards.Writer(out, Rank(r, r, world, world), "sharded-async")
    writer.parts("step-1", model, optimizer)
    if r == 0:
        (out / "a-file").write_text("")
        writer.commit(out / "a-file" / CHECKPOINT_FILE, {shards.TAG_KEY: "step-1"})
    try:
        writer.wait()
    except PipelineError as exc:
        (out / f"said-{r}.txt").write_text(str(exc))


def test_an_asynchronous_checkpoint_that_fails_on_rank_0_is_one_line_on_every_rank(tmp_path):
    """No rank goes on (or stops) before rank 0's file is written, and none waits on a rank that
    has failed: each says the same line, naming rank 0 where it is another's."""
    run_ranks(2, failed_commit, tmp_path)
    said = [(tmp_path / f"said-{r}.txt").read_text() for r in range(2)]
    assert "a-file" in said[0] and "\n" not in said[0]
    assert said[1] == f"rank 0: {said[0]}"


@pytest.mark.fast
def test_an_interrupted_training_whose_parts_are_gone_starts_afresh_saying_so(tmp_path):
    """`dvc repro` after a stop: a checkpoint.pt whose sharded parts were deleted (or never
    finished) is not continued, the reason said, rather than failing in every worker."""
    cfg = TrainConfig()
    expected = trajectory(cfg, "ddp")
    (tmp_path / "code").mkdir()
    inputs = inputs_snapshot(tmp_path / "data", [tmp_path / "code"])
    state = {"model": None, "optimizer": None, "scheduler": {}, "epoch": 1, "history": [], "trajectory": expected,
             shards.TAG_KEY: shards.tag(1, 0), shards.RANKS_KEY: 2}
    torch.save(state, tmp_path / CHECKPOINT_FILE)
    record, settings = {"inputs": inputs, "settings": {"train.lr": 0.02}}, {"train.lr": 0.02}
    why = why_not_continue(tmp_path, record, expected, inputs, settings, world_size=2)
    assert why == f"{tmp_path / shards.SHARDS_DIR / 'epoch-1-step-0'}, where its weights are, is gone or not whole"
    (tmp_path / shards.SHARDS_DIR / "epoch-1-step-0").mkdir(parents=True)
    (tmp_path / shards.SHARDS_DIR / "epoch-1-step-0" / ".metadata").write_bytes(b"")
    assert why_not_continue(tmp_path, record, expected, inputs, settings, world_size=2) is None
