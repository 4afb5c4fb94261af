"""The optimizer and the schedule are settings (`train.optimizer`, `train.schedule`, #53): each
follows its definition, the defaults make the very calls the loop made before (MNIST's weights
stay bit for bit), and any choice, gradient clipping included, trains the same in DDP as on one
device and resumes where it stopped. The trainings are the pipeline's own loop; DDP's ranks run over gloo (tests/ddp_harness.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from pipeline.checkpoint import CHECKPOINT_FILE, read_checkpoint, settings_changed, trajectory
from pipeline.config import OPTIMIZERS, SCHEDULES, TrainConfig
from pipeline.errors import PipelineError
from pipeline.loop import Training, build, check_schedule_length, train
from pipeline.model import build_model
from pipeline.optim import build_optimizer, build_schedule
from pipeline.parallel import Rank
from tests.conftest import relative_difference
from tests.ddp_harness import (Interrupted, equal, learnable_data, run_ranks, stop_after_first_epoch,
                               train_config, train_each)

# The non-default choices trained below: each optimizer and each schedule at least once, and
# clipping (train.max_grad_norm) on one of them.
CHOICES = [("sgd", "cosine", 0.5), ("adamw", "constant", 0.0)]


def rates(optimizer_name: str, schedule: str, steps: int = 100) -> tuple[list[float], list[float]]:
    """The learning rate and momentum (SGD's, or Adam's beta1) each step runs with."""
    config = TrainConfig(optimizer=optimizer_name, schedule=schedule, lr=0.1, momentum=0.8)
    optimizer = build_optimizer(torch.nn.Linear(2, 1).parameters(), config)
    scheduler = build_schedule(optimizer, config, steps)
    lrs, momenta = [], []
    for _ in range(steps):
        group = optimizer.param_groups[0]
        lrs.append(group["lr"])
        momenta.append(group["momentum"] if "momentum" in group else group["betas"][0])
        optimizer.step()
        scheduler.step()
    return lrs, momenta


@pytest.mark.fast
def test_each_schedule_follows_its_definition():
    lrs, momenta = rates("sgd", "constant")
    assert set(lrs) == {0.1} and set(momenta) == {0.8}
    lrs, _ = rates("adamw", "cosine")
    assert lrs[0] == 0.1 and all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] < 1e-4
    assert lrs[50] == pytest.approx(0.05, rel=0.05)  # half way down the half cosine
    lrs, momenta = rates("adam", "onecycle")
    peak = lrs.index(max(lrs))
    assert lrs[0] == pytest.approx(0.1 / 25) and max(lrs) == pytest.approx(0.1) and 25 <= peak <= 35
    assert lrs[-1] < 1e-4 and momenta[0] == 0.95 and min(momenta) == pytest.approx(0.85)  # beta1 cycles
    _, momenta = rates("sgd", "onecycle")
    assert set(momenta) == {0.8}  # SGD keeps the momentum it was given


def trained(model: torch.nn.Module, optimizer, scheduler, steps: int = 30) -> dict:
    """The weights after `steps` steps on fixed batches."""
    data = learnable_data(64)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(data.images[step % 4::4]), data.labels[step % 4::4]).backward()
        optimizer.step()
        scheduler.step()
    return model.state_dict()


@pytest.mark.fast
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_defaults_are_the_adam_and_one_cycle_the_loop_always_built(weight_decay):
    """Bit for bit, 30 steps: the defaults' optimizer and schedule against the two torch calls the
    loop made before they were settings."""
    config = dataclasses.replace(TrainConfig(), weight_decay=weight_decay)
    assert (config.optimizer, config.schedule) == ("adam", "onecycle")
    model, optimizer, scheduler = build(config, 30, torch.device("cpu"))
    reference = build_model("small")
    reference.load_state_dict(model.state_dict())
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    ref_scheduler = torch.optim.lr_scheduler.OneCycleLR(ref_optimizer, max_lr=config.lr, total_steps=30)
    assert equal(trained(model, optimizer, scheduler), trained(reference, ref_optimizer, ref_scheduler))


@pytest.mark.fast
def test_each_optimizer_is_the_one_named_with_its_settings():
    config = TrainConfig(lr=0.03, momentum=0.7, weight_decay=0.01, schedule="constant")
    built = {}
    for name in OPTIMIZERS:
        cfg = dataclasses.replace(config, optimizer=name)
        model, optimizer, scheduler = build(cfg, 30, torch.device("cpu"))
        group = optimizer.param_groups[0]
        assert (group["lr"], group["weight_decay"]) == (0.03, 0.01)
        built[name] = (type(optimizer), group, trained(model, optimizer, scheduler))
    assert [kind for kind, _, _ in built.values()] == [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD]
    assert not built["adam"][1]["decoupled_weight_decay"] and built["adamw"][1]["decoupled_weight_decay"]
    assert built["sgd"][1]["momentum"] == 0.7
    # Decay in the gradient (Adam) and decoupled from it (AdamW) train different weights.
    assert not equal(built["adam"][2], built["adamw"][2])
    assert set(SCHEDULES) == {"onecycle", "cosine", "constant"}  # each followed in the test above


@pytest.mark.fast
def test_a_checkpoint_from_before_the_settings_resumes_as_adam_and_one_cycle():
    config = TrainConfig()
    old = {k: v for k, v in trajectory(config, "single").items()
           if k not in ("optimizer", "schedule", "momentum", "max_grad_norm")}
    assert settings_changed({"trajectory": old}, trajectory(config, "single")) == ""
    sgd = dataclasses.replace(config, optimizer="sgd")
    assert settings_changed({"trajectory": old}, trajectory(sgd, "single")) == \
        "momentum: None -> 0.9, optimizer: 'adam' -> 'sgd'"
    clipping = dataclasses.replace(config, max_grad_norm=1.0)
    assert settings_changed({"trajectory": old}, trajectory(clipping, "single")) == "max_grad_norm: 0.0 -> 1.0"
    cosine = dataclasses.replace(config, schedule="cosine")
    assert settings_changed({"trajectory": old}, trajectory(cosine, "single")) == "schedule: 'onecycle' -> 'cosine'"
    # Momentum is SGD's alone: changing it under Adam changes nothing that trained.
    assert trajectory(dataclasses.replace(config, momentum=0.5), "single") == trajectory(config, "single")
    # A setting this code does not know, saved by a later version, is a difference too.
    later = {**trajectory(config, "single"), "grad_accumulation": 4}
    assert settings_changed({"trajectory": later}, trajectory(config, "single")) == "grad_accumulation: 4 -> None"


@pytest.mark.fast
@pytest.mark.parametrize("schedule", ["onecycle", "cosine", "constant"])
def test_a_schedule_saved_for_another_length_is_refused_on_resume(tmp_path, schedule):
    config = TrainConfig(schedule=schedule)
    _, _, saved = build(config, 20, torch.device("cpu"))
    state = {"scheduler": saved.state_dict()}
    check_schedule_length(state, 20, tmp_path / CHECKPOINT_FILE)
    if schedule == "constant":  # no end to outrun
        check_schedule_length(state, 30, tmp_path / CHECKPOINT_FILE)
        return
    with pytest.raises(PipelineError, match=r"its schedule spans 20 steps and this training 30 \(the training set "
                                            r"changed size\?\): restore the data settings, or delete"):
        check_schedule_length(state, 30, tmp_path / CHECKPOINT_FILE)  # the training set grew since


def test_resume_refuses_a_schedule_of_another_length_before_changing_anything(tmp_path, monkeypatch, mnist_dir):
    """`train --resume` after data.train_limit changed: refused by the stage in one line, before it
    writes the unfinished-training record or touches the runs (#53 review)."""
    from pipeline.config import load_config
    from stages.train import pick_up
    from tests.conftest import ROOT, SMALL, prepare

    project = tmp_path / "proj"
    project.mkdir()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, values in SMALL.items():
        params[section].update(values)
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    prepare(project, mnist_dir)
    config = load_config(project / "params.yaml")
    out = project / "models" / "single"
    out.mkdir(parents=True)
    _, optimizer, scheduler = build(config.train, 7, torch.device("cpu"))  # trained on another slice
    model = build_model(config.workload.init_args["model"])
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "epoch": 1, "history": [], "trajectory": trajectory(config.train, "single"), "extra": {}},
               out / CHECKPOINT_FILE)
    monkeypatch.chdir(project)
    with pytest.raises(PipelineError, match=r"its schedule spans 7 steps and this training 20 "):
        pick_up(config, "single", project / "data" / "prepared", asked=True)
    assert sorted(path.name for path in out.iterdir()) == [CHECKPOINT_FILE]


def test_other_choices_train_the_same_in_ddp_and_resume_bit_for_bit(tmp_path):
    # 1250 images: 10 steps of 128 an epoch, the last one 98 (shares 33/33/32 at 3 ranks).
    configs = [dataclasses.replace(train_config(batch_size=128, epochs=2), optimizer=name, schedule=schedule,
                                   lr=0.05 if name == "sgd" else 0.02, weight_decay=0.01, max_grad_norm=clip)
               for name, schedule, clip in CHOICES]
    train_split, val_split = learnable_data(1250), learnable_data(101, seed=1)
    run_ranks(3, train_each, configs, train_split, val_split, tmp_path / "ddp")
    for i, cfg in enumerate(configs):
        single_dir = tmp_path / f"single-{i}"
        single_dir.mkdir()
        model, history = train(Training(cfg, "single", Rank(), torch.device("cpu"), single_dir), train_split, val_split)
        ddp = torch.load(tmp_path / "ddp" / f"{i}.pt", weights_only=True)
        difference = relative_difference(model.state_dict(), ddp["weights"])
        print(f"{cfg.optimizer} + {cfg.schedule}, 3 ranks: relative |single - ddp| {difference:.2e}")
        assert difference < 1e-4
        assert history[-1]["train_loss"] < history[0]["train_loss"]  # it learns
        assert ddp["history"][-1]["lr_at_epoch_end"] == history[-1]["lr_at_epoch_end"]
        clipped = [epoch["clipped_steps"] for epoch in history]
        assert [epoch["clipped_steps"] for epoch in ddp["history"]] == clipped
        if cfg.max_grad_norm:  # it clipped, and clipping changed what trained
            assert sum(clipped) > 0, clipped
            unclipped_dir = tmp_path / f"unclipped-{i}"
            unclipped_dir.mkdir()
            unclipped, _ = train(Training(dataclasses.replace(cfg, max_grad_norm=0.0), "single", Rank(),
                                          torch.device("cpu"), unclipped_dir), train_split, val_split)
            assert relative_difference(unclipped.state_dict(), model.state_dict()) > 1e-3
        else:
            assert clipped == [0, 0]
        if cfg.schedule == "cosine":
            assert history[-1]["lr_at_epoch_end"] == pytest.approx(0, abs=1e-12)
            assert history[0]["lr_at_epoch_end"] == pytest.approx(cfg.lr / 2)  # half way, down half a cosine
        else:
            assert history[-1]["lr_at_epoch_end"] == cfg.lr

        # Stopped after its first epoch, then resumed from the checkpoint: the momentum buffers or
        # moments and the schedule's step carry over, and the weights are the uninterrupted ones.
        resumed_dir = tmp_path / f"resumed-{i}"
        resumed_dir.mkdir()
        first = Training(cfg, "single", Rank(), torch.device("cpu"), resumed_dir, epoch_hooks=[stop_after_first_epoch])
        with pytest.raises(Interrupted):
            train(first, train_split, val_split)
        state = read_checkpoint(resumed_dir / CHECKPOINT_FILE)
        assert state["epoch"] == 1 and state["trajectory"]["optimizer"] == cfg.optimizer
        again = Training(cfg, "single", Rank(), torch.device("cpu"), resumed_dir, resume_state=state)
        resumed, _ = train(again, train_split, val_split)
        assert equal(resumed.state_dict(), model.state_dict())
