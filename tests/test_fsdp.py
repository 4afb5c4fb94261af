"""fsdp (#56): FSDP2's `fully_shard`, each rank holding 1/W of every parameter, its gradient and its
optimizer state, trains what one device trains on the same global batches, at 1, 2 and 3 ranks (3:
shares of 43/43/42 and shards padded), with gradient accumulation and with clipping by the
global norm of a sharded gradient. The trainings are the pipeline's own loop in real processes
over gloo (tests/ddp_harness.py); the stage's path is tests/test_train_modes.py's, and a mid-epoch
kill and resume tests/test_step_checkpoints.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from pipeline.loop import Training, train
from pipeline.parallel import Rank
from tests.conftest import relative_difference
from tests.ddp_harness import learnable_data, rank_dir, run_ranks, train_config

BASE = train_config(batch_size=128)  # 1250 images: 10 steps, the last one 98
ACCUMULATED = dataclasses.replace(BASE, grad_accum_steps=3)
CLIPPED = dataclasses.replace(BASE, max_grad_norm=0.5, optimizer="sgd")  # every step clipped; sgd: Adam would
# divide most of a wrong norm away again
CONFIGS = {1: [BASE], 2: [BASE, ACCUMULATED], 3: [BASE, ACCUMULATED, CLIPPED]}


def data():
    return learnable_data(1250), learnable_data(101, seed=1)


def fsdp_rank(r: int, world: int, out) -> None:
    """Rank r of an fsdp training under each of the world's configs; rank 0 saves each one's whole
    weights, history and count of reduce-scatters to out/<i>.pt."""
    calls = []
    reduce_scatter = dist.reduce_scatter_single

    def counted(*args, **kwargs):  # what FSDP2 reduces each unit's gradient with (its DefaultReduceScatter)
        calls.append(1)
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counted
    for i, cfg in enumerate(CONFIGS[world]):
        calls.clear()
        run = Training(cfg, "fsdp", Rank(r, r, world, world), torch.device("cpu"), rank_dir(out / str(i), r))
        model, history = train(run, *data())  # raises if the ranks' gathered weights ever differ
        if r == 0:
            torch.save({"weights": model.state_dict(), "history": history, "reduce_scatters": len(calls)},
                       out / f"{i}.pt")


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    trained = {}
    for name, cfg in (("base", BASE), ("clipped", CLIPPED)):
        model, history = train(Training(cfg, "single", Rank(), torch.device("cpu"), rank_dir(out, 0) / name), *data())
        trained[name] = {"weights": model.state_dict(), "history": history}
    return trained


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp_trains_what_one_device_trains(tmp_path, singles, world):
    run_ranks(world, fsdp_rank, tmp_path)
    runs = [torch.load(tmp_path / f"{i}.pt", weights_only=True) for i in range(len(CONFIGS[world]))]
    for cfg, fsdp in zip(CONFIGS[world], runs):
        single = singles["clipped" if cfg.max_grad_norm else "base"]
        difference = relative_difference(single["weights"], fsdp["weights"])
        print(f"{world} rank(s), accumulation {cfg.grad_accum_steps}, clipping {cfg.max_grad_norm}: "
              f"relative |single - fsdp| {difference:.2e}")
        assert difference < 1e-4
        assert fsdp["history"][0]["train_loss"] == pytest.approx(single["history"][0]["train_loss"], rel=1e-5)
        assert fsdp["history"][0]["val_accuracy"] == pytest.approx(single["history"][0]["val_accuracy"], abs=1 / 101)
        # Clipped by the whole gradient's norm, not a shard's: the same steps as one device clips.
        assert fsdp["history"][0]["clipped_steps"] == single["history"][0]["clipped_steps"]
    assert singles["clipped"]["history"][0]["clipped_steps"] == 10  # the bound bites on every step
    if world > 1:
        # Accumulation reduce-scatters once a step, in its last micro-batch, not once per micro-batch.
        assert runs[0]["reduce_scatters"] > 0 and runs[1]["reduce_scatters"] == runs[0]["reduce_scatters"]
        if world > 2:  # the clipped training moved elsewhere than the unclipped one
            assert relative_difference(runs[0]["weights"], runs[2]["weights"]) > 1e-3
