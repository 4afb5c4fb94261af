"""fp16 autocast with a loss scaler (`train.fp16`, #56), proven on the CPU, where torch's float16
autocast and GradScaler run for real: the scale backs off on the steps whose gradient overflowed
and those steps are skipped; DDP's ranks skip alike and train what one device trains, to fp16's
rounding; and a resume goes on with the scale the checkpoint holds, bit for bit, where a fresh
scale would have trained other weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.checkpoint import CHECKPOINT_FILE, read_checkpoint, settings_changed, trajectory
from pipeline.config import TrainConfig
from pipeline.loop import Training, train
from pipeline.parallel import Rank
from pipeline.precision import autocast_dtype, grad_scaler
from tests.conftest import relative_difference
from tests.ddp_harness import (Interrupted, equal, learnable_data, run_ranks, stop_after_first_epoch,
                               train_config, train_each)

CPU = torch.device("cpu")
FRESH_SCALE = 65536.0  # GradScaler's first scale


def fp16_config(lr: float) -> TrainConfig:
    # 400 images in steps of 40. At lr 0.02 the first steps' gradients overflow float16 at the first
    # scales; at lr 0.001 none does, in either mode.
    return dataclasses.replace(train_config(batch_size=40, epochs=2), fp16=True, lr=lr)


def folder(tmp_path, name: str):
    path = tmp_path / name
    path.mkdir()
    return path


@pytest.mark.fast
def test_only_fp16_gets_float16_and_a_scaler_and_a_resume_keeps_to_it():
    assert grad_scaler(CPU, fp16=False) is None
    assert isinstance(grad_scaler(CPU, fp16=True), torch.amp.GradScaler)
    assert autocast_dtype(CPU, bf16=True, fp16=True) == torch.float16  # wherever asked, the CPU included
    assert autocast_dtype(CPU, bf16=True) is None
    config = TrainConfig()
    assert settings_changed({"trajectory": trajectory(config, "single")},
                            trajectory(dataclasses.replace(config, fp16=True), "single")) == "fp16: False -> True"
    before = {k: v for k, v in trajectory(config, "single").items() if k != "fp16"}  # a checkpoint from before
    assert settings_changed({"trajectory": before}, trajectory(config, "single")) == ""


def test_fp16_skips_overflowed_steps_clips_the_true_gradient_and_resumes_with_its_scale(tmp_path):
    cfg = dataclasses.replace(fp16_config(lr=0.02), max_grad_norm=2.0)
    train_split, val_split = learnable_data(400), learnable_data(50, seed=1)
    model, history = train(Training(cfg, "single", Rank(), CPU, folder(tmp_path, "whole")), train_split, val_split)
    scales = [epoch["loss_scale"] for epoch in history]
    print(f"fp16 loss scale after each epoch: {scales}")
    assert scales[0] < FRESH_SCALE  # a step of the first epoch overflowed: it was skipped, the scale halved
    assert all(torch.isfinite(w).all() for w in model.state_dict().values())  # no overflow reached the weights
    assert history[-1]["train_loss"] < history[0]["train_loss"]  # it learns
    # Clipping saw the unscaled gradient: a scaled one (thousands of times larger) is over 2 every step.
    assert history[-1]["clipped_steps"] < 10

    # Stopped after its first epoch, then resumed from the checkpoint: the scale carries over.
    resumed_dir = folder(tmp_path, "resumed")
    with pytest.raises(Interrupted):
        train(Training(cfg, "single", Rank(), CPU, resumed_dir, epoch_hooks=[stop_after_first_epoch]),
              train_split, val_split)
    state = read_checkpoint(resumed_dir / CHECKPOINT_FILE)
    assert state["scaler"]["scale"] == scales[0]
    resumed, resumed_history = train(Training(cfg, "single", Rank(), CPU, resumed_dir, resume_state=state),
                                     train_split, val_split)
    assert equal(resumed.state_dict(), model.state_dict())
    # Without the scale it saved, the resume would start again at the first scale and end there,
    # and count its clean steps towards the next doubling afresh.
    assert [epoch["loss_scale"] for epoch in resumed_history] == scales
    assert read_checkpoint(resumed_dir / CHECKPOINT_FILE)["scaler"] == read_checkpoint(
        tmp_path / "whole" / CHECKPOINT_FILE)["scaler"]


def test_fp16_ddp_trains_what_one_device_trains_while_no_step_overflows(tmp_path):
    """A DDP rank's backward carries W times one device's gradient magnitudes (its loss is its
    share's over L/W; the all-reduce averages after), so it can overflow, and skip, a step one
    device does not: the modes agree to fp16's rounding where neither overflows. Where both do, the
    ranks skip alike (the loop stops on weights that differ between ranks) and back off."""
    calm, overflowing = fp16_config(lr=0.001), fp16_config(lr=0.02)
    train_split, val_split = learnable_data(400), learnable_data(50, seed=1)
    run_ranks(2, train_each, [calm, overflowing], train_split, val_split, tmp_path / "ddp")
    ddp = torch.load(tmp_path / "ddp" / "0.pt", weights_only=True)
    assert [epoch["loss_scale"] for epoch in ddp["history"]] == [FRESH_SCALE] * 2
    assert torch.load(tmp_path / "ddp" / "1.pt", weights_only=True)["history"][-1]["loss_scale"] < FRESH_SCALE

    model, history = train(Training(calm, "single", Rank(), CPU, folder(tmp_path, "single")), train_split, val_split)
    assert [epoch["loss_scale"] for epoch in history] == [FRESH_SCALE] * 2
    float32, _ = train(Training(dataclasses.replace(calm, fp16=False), "single", Rank(), CPU,
                                folder(tmp_path, "float32")), train_split, val_split)
    difference = relative_difference(model.state_dict(), ddp["weights"])
    from_float32 = relative_difference(model.state_dict(), float32.state_dict())
    print(f"fp16, 2 ranks: relative |single - ddp| {difference:.2e}; |fp16 - float32| {from_float32:.2e}")
    assert difference < 2e-3
    assert from_float32 > 5 * difference  # it did train in fp16: the bound tells it from float32

    # fsdp the same, through what only a GPU's bf16 otherwise takes: the autocast wrapper around the
    # sharded network (pipeline.precision), and GradScaler over sharded gradients, whose overflow
    # DTensor agrees on over the ranks (the overflowing training backs off alike, without a hang).
    run_ranks(2, train_each, [calm, overflowing], train_split, val_split, tmp_path / "fsdp", "fsdp")
    fsdp = torch.load(tmp_path / "fsdp" / "0.pt", weights_only=True)
    assert [epoch["loss_scale"] for epoch in fsdp["history"]] == [FRESH_SCALE] * 2
    assert relative_difference(model.state_dict(), fsdp["weights"]) < 2e-3
    backed_off = torch.load(tmp_path / "fsdp" / "1.pt", weights_only=True)["history"]
    assert [epoch["loss_scale"] for epoch in backed_off] == [epoch["loss_scale"] for epoch in
                                                            torch.load(tmp_path / "ddp" / "1.pt", weights_only=True)["history"]]
    # The checkpoint's optimizer state is keyed by the network's own names, not the wrapper's.
    saved = read_checkpoint(tmp_path / "fsdp" / "0" / "rank-0" / CHECKPOINT_FILE)
    assert set(saved["optimizer"]["state"]) == set(saved["model"]) == set(model.state_dict())
