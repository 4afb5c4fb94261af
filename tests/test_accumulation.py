"""Gradient accumulation (`train.grad_accum_steps`, #56): each rank's share of a global batch in
micro-batches, one optimizer step. It trains what no accumulation trains, to rounding, on one
device and in DDP, and DDP all-reduces once a step, not once a micro-batch. The trainings are the
pipeline's own loop; DDP's ranks run over gloo (tests/ddp_harness.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pipeline.breakdown import Probe
from pipeline.checkpoint import settings_changed, trajectory
from pipeline.config import TrainConfig, load_config
from pipeline.errors import ConfigError
from pipeline.loop import Training, build, epoch_order, micro_batches, run_epoch, train, wrap_for_mode
from pipeline.parallel import Rank, check_every_mode
from tests.conftest import relative_difference
from tests.ddp_harness import learnable_data, run_ranks, train_config, train_each

ACCUMULATED = 3


@pytest.mark.fast
def test_micro_batches_cover_the_share_in_order_and_keep_the_last():
    share = torch.arange(10, 53, 3)  # 15 samples
    parts = micro_batches(share, 4)
    assert [len(p) for p in parts] == [4, 4, 4, 3] and torch.equal(torch.cat(parts), share)
    assert [len(p) for p in micro_batches(share, 1)] == [15]
    # A share shorter than the count (the epoch's short last batch): no empty part runs, except the
    # last, in whose backward DDP all-reduces on every rank.
    assert [len(p) for p in micro_batches(torch.arange(2), 4)] == [1, 1, 0]
    assert [len(p) for p in micro_batches(torch.arange(0), 3)] == [0]


@pytest.mark.fast
def test_micro_batches_that_would_hold_no_sample_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"train.grad_accum_steps = 200 is more than train.batch_size = 128"):
        TrainConfig(grad_accum_steps=200)
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  grad_accum_steps: 0\n")
    with pytest.raises(ConfigError, match=r"train.grad_accum_steps"):
        load_config(params)
    # 128 on 4 ranks is 32 each: 33 micro-batches cannot all hold one.
    with pytest.raises(ConfigError, match=r"ddp \(in train.modes\): train.grad_accum_steps = 33 micro-batches cannot "
                                          r"all hold a sample of each of 4 ranks' shares of train.batch_size = 128 "
                                          r"\(32 samples\): lower train.grad_accum_steps to at most 32"):
        check_every_mode(TrainConfig(grad_accum_steps=33, nproc=4))
    check_every_mode(TrainConfig(grad_accum_steps=32, nproc=4))


@pytest.mark.fast
def test_a_resume_under_another_accumulation_is_refused_and_old_checkpoints_had_none():
    config = TrainConfig()
    accumulated = dataclasses.replace(config, grad_accum_steps=4)
    assert settings_changed({"trajectory": trajectory(config, "ddp")}, trajectory(accumulated, "ddp")) == \
        "grad_accum_steps: 1 -> 4"
    before = {k: v for k, v in trajectory(config, "ddp").items() if k != "grad_accum_steps"}
    assert settings_changed({"trajectory": before}, trajectory(config, "ddp")) == ""


class AllReduceCount:
    """DDP's all-reduce as a comm hook (the same sum of 1/W-scaled buckets), counting its calls."""

    def __init__(self, world: int):
        self.world, self.calls = world, 0

    def hook(self, _state, bucket):  # a method: DDP reads its hook's __name__
        self.calls += 1
        buffer = bucket.buffer().mul_(1.0 / self.world)
        return torch.distributed.all_reduce(buffer, async_op=True).get_future().then(lambda done: done.value()[0])


def ddp_rank(r: int, world: int, configs: list[TrainConfig], train_split, val_split, out) -> None:
    # The whole DDP training under the last config alone (out/0.pt): the first's, without
    # accumulation, is compared with nothing.
    train_each(r, world, configs[-1:], train_split, val_split, out)
    # One epoch of the loop's steps with a counting hook: all-reduces a step, with and without accumulation.
    counts = []
    for cfg in configs:
        model, optimizer, scheduler = build(cfg, 10, torch.device("cpu"))
        wrapped = wrap_for_mode(model, cfg, torch.device("cpu"), "ddp")
        assert isinstance(wrapped, nn.parallel.DistributedDataParallel)
        counter = AllReduceCount(world)
        wrapped.register_comm_hook(None, counter.hook)
        run_epoch(wrapped, optimizer, scheduler, train_split, epoch_order(len(train_split), 0, cfg.seed),
                  cfg.batch_size, Rank(r, r, world, world), Probe(torch.device("cpu")), show_bar=False, desc="",
                  grad_accum_steps=cfg.grad_accum_steps)
        counts.append(counter.calls)
    if r == 0:
        torch.save(counts, out / "all_reduces.pt")


def test_accumulation_trains_what_one_pass_trains_on_one_device_and_in_ddp(tmp_path):
    # 1250 images: 10 steps of 128, the last one 98. At 3 ranks the shares are 43/43/42 (micro-batches
    # of 15/14/14 and 14/14/14), and 33/33/32 in the last step.
    plain = train_config(batch_size=128, epochs=1)
    accumulated = dataclasses.replace(plain, grad_accum_steps=ACCUMULATED)
    train_split, val_split = learnable_data(1250), learnable_data(101, seed=1)
    run_ranks(3, ddp_rank, [plain, accumulated], train_split, val_split, tmp_path / "ddp")

    single = {}
    for name, cfg in (("plain", plain), ("accumulated", accumulated)):
        folder = tmp_path / f"single-{name}"
        folder.mkdir()
        single[name] = train(Training(cfg, "single", Rank(), torch.device("cpu"), folder), train_split, val_split)
    weights = {"single": single["plain"][0].state_dict(),
               "single, accumulated": single["accumulated"][0].state_dict(),
               "ddp, accumulated": torch.load(tmp_path / "ddp" / "0.pt", weights_only=True)["weights"]}
    for name in ("single, accumulated", "ddp, accumulated"):
        difference = relative_difference(weights["single"], weights[name])
        print(f"{name} ({ACCUMULATED} micro-batches) against single: relative difference {difference:.2e}")
        assert difference < 1e-4
    # The same samples, so to rounding the same loss, and the same predictions but for a tie or two.
    plain_epoch, accumulated_epoch = single["plain"][1][0], single["accumulated"][1][0]
    assert accumulated_epoch["train_loss"] == pytest.approx(plain_epoch["train_loss"], rel=1e-5)
    assert accumulated_epoch["train_accuracy"] == pytest.approx(plain_epoch["train_accuracy"], abs=2 / 1250)

    # Accumulation rounds differently: the weights are not the very same bits (the comparison
    # above could not tell an accumulating loop from one that ignores the setting).
    assert not all(torch.equal(a, b) for a, b in zip(weights["single"].values(), weights["single, accumulated"].values()))

    plain_calls, accumulated_calls = torch.load(tmp_path / "ddp" / "all_reduces.pt")
    print(f"all-reduce calls in 10 steps: {plain_calls} without accumulation, {accumulated_calls} with {ACCUMULATED}")
    assert plain_calls >= 10 and accumulated_calls == plain_calls  # no all-reduce in a non-final micro-batch
