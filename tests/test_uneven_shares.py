"""Any world size up to the global batch trains what one device trains: shares that differ by one
sample, each rank's loss scaled so that DDP's average of the gradients is the batch's mean gradient.

The DDP runs here are the pipeline's own loop (`pipeline.loop.train`, wrapped in real
DistributedDataParallel) in real processes over gloo (tests/ddp_harness.py).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.errors import ConfigError
from pipeline.loop import DeviceSplit, Training, epoch_order, global_batches, rank_share, share_loss, train
from pipeline.model import build_model
from pipeline.workloads.mnist import Mnist
from pipeline.parallel import Rank, batch_shares, check_world_size, dp_shares, shares_label
from tests.conftest import relative_difference
from tests.ddp_harness import learnable_data, rank_dir, run_ranks, train_config


def test_shares_differ_by_at_most_one_and_deal_out_every_sample():
    assert shares_label(batch_shares(128, 3)) == "43/43/42"
    assert shares_label(batch_shares(128, 5)) == "26/26/26/25/25"
    assert batch_shares(128, 128) == [1] * 128
    for world in (1, 2, 3, 5, 6, 7, 12, 24):
        order = epoch_order(1003, 2, 7)
        batches = global_batches(order, 128)
        assert len(batches[-1]) == 1003 % 128  # the last, shorter batch is dealt out the same way
        for batch in batches:
            shares = [rank_share(batch, Rank(r, r, world, world)) for r in range(world)]
            assert [len(s) for s in shares] == batch_shares(len(batch), world)
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
            assert sorted(torch.cat(shares).tolist()) == sorted(batch.tolist())  # each sample once


def test_a_world_larger_than_the_batch_is_refused_naming_both():
    check_world_size(128, 128)
    with pytest.raises(ConfigError, match=r"train.batch_size = 128 is smaller than the 129 DDP ranks"):
        check_world_size(128, 129)


def test_dataparallel_shares_are_torch_chunk_pieces():
    assert dp_shares(128, 3) == [43, 43, 42]
    assert dp_shares(128, 5) == [26, 26, 26, 26, 24]  # chunk, not an even deal: DP's scatter calls chunk
    assert dp_shares(5, 4) == [2, 2, 1]  # fewer pieces than GPUs: DataParallel uses three replicas
    assert dp_shares(128, 1) == [128]


def train_single(tmp_path, cfg: TrainConfig, train_split: DeviceSplit, val_split: DeviceSplit) -> dict:
    out = tmp_path / "single"
    out.mkdir()
    model, history = train(Training(cfg, "single", Rank(), torch.device("cpu"), out), train_split, val_split)
    return {"weights": model.state_dict(), "history": history}


def ddp_rank(r: int, world: int, trainings: dict[str, tuple], out) -> None:
    """Rank r of each of `trainings` (name: config, train split, val split) in turn; rank 0 saves
    each one's weights and history to out/<name>.pt."""
    for name, (cfg, train_split, val_split) in trainings.items():
        run = Training(cfg, "ddp", Rank(r, r, world, world), torch.device("cpu"), rank_dir(out / name, r))
        model, history = train(run, train_split, val_split)  # raises if the ranks' weights ever differ
        if r == 0:
            torch.save({"weights": model.state_dict(), "history": history}, out / f"{name}.pt")


def train_ddp(out, world: int, trainings: dict[str, tuple]) -> dict[str, dict]:
    run_ranks(world, ddp_rank, trainings, out)
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in trainings}


def odd_world():
    # 1250 images: 10 steps of the default global batch 128, the last one 98 (not a multiple of 3 or 5).
    return train_config(batch_size=128), learnable_data(1250), learnable_data(101, seed=1)


def short_last_batch():
    # 5 ranks, batch 8: shares 2/2/2/1/1; 27 images leave a last batch of 3, so ranks 3 and 4 train on
    # nothing in that step, yet still take part in its all-reduce with zero gradients.
    return train_config(batch_size=8, epochs=2), learnable_data(27), learnable_data(7, seed=1)


@pytest.fixture(scope="module")
def five_ranks(tmp_path_factory) -> dict[str, dict]:
    """Both 5-rank DDP trainings of this file, the odd world's and the short last batch's, in one
    start of 5 processes, not two (each process imports torch and the pipeline afresh, most of its
    cost; each training seeds its own weights and draws)."""
    return train_ddp(tmp_path_factory.mktemp("ddp-5"), 5, {"odd": odd_world(), "short": short_last_batch()})


@pytest.mark.parametrize("world", [3, 5])
def test_ddp_at_odd_world_sizes_trains_what_one_device_trains(tmp_path, request, world):
    cfg, train_split, val_split = odd_world()
    single = train_single(tmp_path, cfg, train_split, val_split)
    if world == 5:
        ddp = request.getfixturevalue("five_ranks")["odd"]
    else:
        ddp = train_ddp(tmp_path / f"ddp-{world}", world, {"odd": odd_world()})["odd"]
    difference = relative_difference(single["weights"], ddp["weights"])
    print(f"{world} ranks, 10 steps: relative |single - ddp| {difference:.2e}")
    assert difference < 1e-4
    # Every sample counted once, on all ranks together, and the same validation figures.
    assert ddp["history"][0]["train_loss"] == pytest.approx(single["history"][0]["train_loss"], rel=1e-4)
    assert ddp["history"][0]["val_accuracy"] == pytest.approx(single["history"][0]["val_accuracy"], abs=1 / 101)
    torch.manual_seed(cfg.seed)  # the initial weights, as the loop builds them
    assert relative_difference(build_model("small").state_dict(), single["weights"]) > 1e-2  # it trained


def test_a_last_batch_smaller_than_the_world_leaves_some_ranks_empty_and_still_agrees(tmp_path, five_ranks):
    cfg, train_split, val_split = short_last_batch()
    single = train_single(tmp_path, cfg, train_split, val_split)
    ddp = five_ranks["short"]
    assert relative_difference(single["weights"], ddp["weights"]) < 1e-4
    assert ddp["history"][-1]["train_loss"] == pytest.approx(single["history"][-1]["train_loss"], rel=1e-4)


def test_uneven_dataparallel_chunks_give_the_single_device_gradient():
    """DataParallel on N GPUs, modelled on the CPU step by step: scatter with torch.chunk, one
    replica per piece run in its own thread (parallel_apply), outputs gathered on the first
    device, the loop's own loss on them, and each replica's gradient summed into the module
    (replicate's backward). It must give the gradient of the whole batch on one device."""
    torch.manual_seed(0)
    model = build_model("small")
    batch = learnable_data(128)
    loss, _ = share_loss(model(batch.images), batch.labels, 128, 1, Mnist().loss)
    loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]

    for devices in (3, 5, 7):
        pieces = batch.images.chunk(devices)
        assert [len(p) for p in pieces] == dp_shares(128, devices)
        replicas = [copy.deepcopy(model) for _ in pieces]
        for replica in replicas:
            replica.zero_grad(set_to_none=True)
        outputs: list = [None] * len(pieces)

        def forward(i: int) -> None:
            outputs[i] = replicas[i](pieces[i])

        threads = [threading.Thread(target=forward, args=(i,)) for i in range(len(pieces))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        gathered = torch.cat(outputs)
        loss, _ = share_loss(gathered, batch.labels, len(batch.labels), 1, Mnist().loss)
        loss.backward()
        summed = [sum(r_params) for r_params in zip(*[[p.grad for p in r.parameters()] for r in replicas])]
        for got, want in zip(summed, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
