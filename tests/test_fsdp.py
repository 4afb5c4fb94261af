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

from pipeline import shards
from pipeline.checkpoint import CHECKPOINT_FILE, read_checkpoint
from pipeline.errors import PipelineError
from pipeline.loop import Training, build, full_parameters, train, wrap_for_mode
from pipeline.optim import build_optimizer
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
    weights, history and count of reduce-scatters to out/<i>.pt. At 3 ranks, the short last batch's
    training follows in the same processes (short_last_batch_rank, to out/short)."""
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
    dist.reduce_scatter_single = reduce_scatter
    if world == 3:
        short_last_batch_rank(r, world, out / "short")


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """The folder of the 3-rank fsdp trainings, CONFIGS[3]'s and the short last batch's: one start of
    3 processes for both tests that read them, not two (each process imports torch and the pipeline
    afresh, most of its cost; each training seeds its own weights and draws)."""
    out = tmp_path_factory.mktemp("fsdp-3")
    run_ranks(3, fsdp_rank, out)
    return out


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    trained = {}
    for name, cfg in (("base", BASE), ("clipped", CLIPPED)):
        model, history = train(Training(cfg, "single", Rank(), torch.device("cpu"), rank_dir(out, 0) / name), *data())
        trained[name] = {"weights": model.state_dict(), "history": history}
    return trained


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp_trains_what_one_device_trains(tmp_path, request, singles, world):
    if world == 3:
        out = request.getfixturevalue("three_ranks")
    else:
        out = tmp_path
        run_ranks(world, fsdp_rank, out)
    runs = [torch.load(out / f"{i}.pt", weights_only=True) for i in range(len(CONFIGS[world]))]
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


def short_last_batch_rank(r: int, world: int, out) -> None:
    """fsdp with more micro-batches than the short last batch gives some ranks samples: batch 12 on 3
    ranks (4 each) in 4 micro-batches, and 125 images end on a batch of 5 (2/2/1), so a rank holds
    an empty micro-batch there that another rank has a sample in. Every forward gathers weights: the
    ranks must run as many, or wait on each other for good."""
    cfg = dataclasses.replace(train_config(batch_size=12), grad_accum_steps=4)
    run = Training(cfg, "fsdp", Rank(r, r, world, world), torch.device("cpu"), rank_dir(out, r))
    model, history = train(run, learnable_data(125), learnable_data(31, seed=1))
    if r == 0:
        torch.save({"weights": model.state_dict(), "history": history}, out / "fsdp.pt")


@pytest.mark.parametrize("config", [0, 1], ids=["plain", "accumulated"])
def test_each_step_s_all_gathers_and_reduce_scatters_are_timed_and_exposed(three_ranks, config):
    """The last epoch's breakdown on every rank: each unit's weights all-gathered for its forward and
    again for its backward (each micro-batch's), its gradient reduce-scattered once a step, whole
    padded buffers of the bytes the shards make; on the CPU each call holds the training thread, so
    all of it is exposed, and the phases less it still add up to the step. The weights are those the
    other tests compare with single's: the timed collectives are FSDP's own."""
    from pipeline.model import build_model
    from pipeline.parallel import shard_units

    world, cfg = 3, CONFIGS[3][config]
    units = list(shard_units(build_model("small")))
    # FSDP2 pads each parameter's first dimension to a multiple of the world: the gathered buffer.
    padded = sum(-(-p.shape[0] // world) * world * p[0].numel() * p.element_size()
                 for unit in units for p in unit.parameters())
    ranks = torch.load(three_ranks / f"{config}.pt", weights_only=True)["history"][-1]["breakdown"]
    assert len(ranks) == world
    for rank in ranks:
        kinds, median = rank["collectives"], rank["median_s"]
        assert kinds["all_gather"]["calls"] == 2 * len(units) * cfg.grad_accum_steps, kinds
        assert kinds["reduce_scatter"]["calls"] == len(units), kinds
        assert kinds["all_gather"]["bytes"] == 2 * padded * cfg.grad_accum_steps
        assert kinds["reduce_scatter"]["bytes"] == padded
        assert all(k["median_s"] > 0 for k in kinds.values())
        assert rank["comm_overlap_fraction"] == 0.0 and median["comm_exposed"] == median["comm"] > 0
        assert median["forward_compute"] < median["forward"] and median["backward_compute"] < median["backward"]
        parts = sum(median[p] for p in ("data", "forward_compute", "backward_compute", "comm_exposed", "optimizer"))
        assert parts == pytest.approx(median["step"], rel=0.25)  # medians of each part: about the step


def test_fsdp_accumulates_over_a_short_last_batch_that_leaves_a_rank_empty_parts(tmp_path, three_ranks):
    single, history = train(Training(dataclasses.replace(train_config(batch_size=12), grad_accum_steps=1), "single",
                                     Rank(), torch.device("cpu"), rank_dir(tmp_path / "single", 0)),
                            learnable_data(125), learnable_data(31, seed=1))
    fsdp = torch.load(three_ranks / "short" / "fsdp.pt", weights_only=True)
    assert relative_difference(single.state_dict(), fsdp["weights"]) < 1e-4
    assert fsdp["history"][0]["train_loss"] == pytest.approx(history[0]["train_loss"], rel=1e-5)


def hybrid_rank(r: int, world: int, out) -> None:
    """Rank r of 4, as 2 nodes of 2 workers (torchrun numbers a node's workers in a row): fsdp
    sharded in full over the 4, then hybrid, sharded within each node and replicated across the two."""
    for sharding in ("full", "hybrid"):
        cfg = dataclasses.replace(BASE, fsdp_sharding=sharding)
        run = Training(cfg, "fsdp", Rank(r, r % 2, world, 2), torch.device("cpu"), rank_dir(out / sharding, r))
        model, history = train(run, *data())
        if r == 0:
            torch.save({"weights": model.state_dict(), "history": history}, out / f"{sharding}.pt")
    sharded_checkpoint_round_trip(Rank(r, r % 2, world, 2), out / "sharded-checkpoint", cfg)
    # Its checkpoint, resumed by 4 workers on one node: 1 replica, not 2, so refused before any step.
    # Rank 0 writes it after the epoch's last collective: the others wait for that (a restarted job's
    # workers find it written).
    dist.barrier()
    state = read_checkpoint(out / "hybrid" / "rank-0" / CHECKPOINT_FILE)
    run = Training(cfg, "fsdp", Rank(r, r, world, world), torch.device("cpu"), rank_dir(out / "hybrid", r),
                   resume_state=state)
    with pytest.raises(PipelineError) as refused:
        train(run, *data())
    if r == 0:
        (out / "refused.txt").write_text(str(refused.value))


def sharded_checkpoint_round_trip(rank: Rank, folder, cfg) -> None:
    """train.checkpoint_format: sharded under the 2-D mesh: each rank writes its part of a model
    stepped once, and another model (other weights) reads them back; then both step again alike.
    A buffer that differs by rank (BatchNorm's statistics between two forwards) is rank 0's, as in
    a whole checkpoint."""
    def built(seed: int):
        model, _, _ = build(dataclasses.replace(cfg, seed=seed), 10, torch.device("cpu"))
        for i in range(4):  # several, so that torch's planner would spread them over the ranks
            model.register_buffer(f"rank_statistic_{i}", torch.full((1000 * (i + 1),), float(rank.rank + seed)))
        wrapped = wrap_for_mode(model, cfg, torch.device("cpu"), "fsdp", nodes=2)
        return model, wrapped, build_optimizer(wrapped.parameters(), cfg)

    inputs = torch.rand(8, 1, 28, 28)
    model, wrapped, optimizer = built(cfg.seed)
    wrapped(inputs).sum().backward()
    optimizer.step()
    shards.save(folder, "stepped-once", model, optimizer, rank=rank)
    other, other_wrapped, other_optimizer = built(cfg.seed + 1)
    shards.load(folder, {shards.TAG_KEY: "stepped-once"}, other, other_optimizer)
    read = all(torch.equal(a, b) for a, b in zip(full_parameters(model), full_parameters(other))) \
        and all(torch.equal(buffer, torch.full_like(buffer, float(cfg.seed))) for name, buffer in other.named_buffers()
                if name.startswith("rank_statistic"))
    for module, step in ((wrapped, optimizer), (other_wrapped, other_optimizer)):
        step.zero_grad()
        module(inputs).sum().backward()
        step.step()
    stepped = all(torch.equal(a, b) for a, b in zip(full_parameters(model), full_parameters(other)))
    if rank.rank == 0:
        (folder.parent / "sharded-checkpoint.txt").write_text(f"{read} {stepped}")


def test_hybrid_sharding_shards_within_a_node_and_replicates_across_nodes(tmp_path, singles):
    """The 2-D mesh as the tests' two hosts would have it, on one: what it trains is one device's, and
    each rank holds half of the model's state (its node's share), not a quarter as when sharded over
    all 4. (On two real hosts: tests/test_multinode.py.)"""
    run_ranks(4, hybrid_rank, tmp_path)
    full, hybrid = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("full", "hybrid"))
    for trained in (full, hybrid):
        assert relative_difference(singles["base"]["weights"], trained["weights"]) < 1e-4
    full_mb, hybrid_mb = full["history"][0]["rank_state_mb"], hybrid["history"][0]["rank_state_mb"]
    assert len(hybrid_mb) == 4 and len(set(hybrid_mb)) <= 2  # each node's two ranks: its halves
    assert 1.8 < sum(hybrid_mb) / sum(full_mb) < 2.2, (hybrid_mb, full_mb)
    assert "was trained with 2 replica(s) of the model (train.fsdp_sharding: hybrid, one a node), and this training " \
           "has 1" in (tmp_path / "refused.txt").read_text()
    # A sharded checkpoint under the 2-D mesh reads back the weights and the optimizer state as written.
    assert (tmp_path / "sharded-checkpoint.txt").read_text() == "True True"
