"""Every call sequence the ranks issue, replayed under NCCL's in-order, blocking rules
(tests/nccl_model.py): what passes on gloo must not hang on GPUs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline import comm
from pipeline.config import CommcheckConfig
from pipeline.parallel import Rank
from tests.nccl_model import Collective, Group, P2P, recording, replay

CPU = torch.device("cpu")


def queues_of(world: int, calls) -> list[list]:
    """Each rank's recorded calls when `calls(rank)` runs as that rank (nothing is sent)."""
    queues = []
    for r in range(world):
        ops: list = []
        with recording(ops, communicate=False):
            calls(Rank(r, r, world, world))
        queues.append(ops)
    return queues


@pytest.mark.parametrize("world", range(2, 9))
@pytest.mark.fast
def test_the_commcheck_sweep_drains_under_nccl_ordering(world):
    # The whole sweep, every primitive at three sizes: what commcheck's workers issue, in their order.
    # (No time budget: with one, the ranks agree on where to stop through a real all_reduce.)
    config = CommcheckConfig(min_bytes=4, max_bytes=64, factor=4, warmup=1, iters=2, budget_s=0)
    queues = queues_of(world, lambda rank: comm.sweep(rank, CPU, config))
    assert all(len(q) == len(queues[0]) for q in queues)
    assert replay(queues) is None


@pytest.mark.parametrize("world", range(2, 9))
def test_the_ring_exchange_commcheck_used_before_deadlocks_on_nccl(world):
    """The model must catch the bug it was built for: each rank posting irecv(left), then
    isend(right), unbatched. On gloo that passes; on NCCL every rank's receive waits on a send
    queued behind its peer's own receive."""
    def unbatched_ring(rank: Rank) -> None:
        r, n = rank.rank, rank.world_size
        out, buf = torch.empty(4), torch.ones(4)
        for work in (dist.irecv(out, src=(r - 1) % n), dist.isend(buf, dst=(r + 1) % n)):
            work.wait()

    verdict = replay(queues_of(world, unbatched_ring))
    assert verdict is not None and verdict.startswith("deadlock")
    assert f"rank 0 waits in recv from rank {world - 1}" in verdict


def test_isend_irecv_is_posted_as_one_group():
    def exchange(rank: Rank) -> None:
        case = comm.make_case("isend_irecv", rank, 4, CPU)
        case.setup()
        case.run()

    queues = queues_of(3, exchange)
    assert queues[1] == [Group((P2P("recv", 0, 4), P2P("send", 2, 4)))]


def test_the_model_tells_matching_from_mismatched_sequences():
    send, recv = P2P("send", 1, 4), P2P("recv", 0, 4)
    assert replay([[send], [recv]]) is None
    assert replay([[Collective("all_reduce"), send], [Collective("all_reduce"), recv]]) is None
    # A collective one rank issues before its send, the other after its receive: both wait forever.
    assert replay([[Collective("barrier"), send], [recv, Collective("barrier")]]).startswith("deadlock")
    assert "disagree" in replay([[Collective("broadcast", 0)], [Collective("broadcast", 1)]])
    assert replay([[P2P("send", 1, 4)], [P2P("recv", 0, 8)]]).startswith("deadlock")  # sizes differ


def record_training_and_resume(r: int, world: int, out) -> None:
    """What a DDP worker issues besides DDP's own gradient all-reduces (the reducer's, in one order
    on every rank): the loop's per-epoch sums and checks, then, as after a restart, the resume
    exchange, with the newest checkpoint on rank 1's disk only. Recorded over real gloo, since
    what the resume sends depends on what it received."""
    import pickle

    from pipeline.checkpoint import CHECKPOINT_FILE, resume_state, trajectory
    from pipeline.loop import Training, train
    from tests.ddp_harness import learnable_data, rank_dir, train_config

    cfg = train_config(batch_size=16, epochs=2)
    rank = Rank(r, r, world, world)
    ops: list = []
    with recording(ops, communicate=True):
        # 34 images: batches 16, 16 and 2, so rank 2 has nothing in the last step and joins it anyway.
        train(Training(cfg, "ddp", rank, CPU, rank_dir(out, r)), learnable_data(34), learnable_data(9, seed=1))
        dist.barrier()  # rank 0 has written its checkpoint: move it to rank 1's disk, as after a restart
        if r == 1:
            (rank_dir(out, 0) / CHECKPOINT_FILE).rename(rank_dir(out, 1) / CHECKPOINT_FILE)
        dist.barrier()
        state = resume_state(rank_dir(out, r) / CHECKPOINT_FILE, trajectory(cfg, "ddp"), asked=False,
                             restarted=True, rank=rank)
        train(Training(cfg, "ddp", rank, CPU, rank_dir(out, r), resume_state=state),
              learnable_data(34), learnable_data(9, seed=1))
    (out / f"calls-{r}.pkl").write_bytes(pickle.dumps(ops))


def test_training_and_the_resume_exchange_drain_under_nccl_ordering(tmp_path):
    import pickle

    from tests.ddp_harness import run_ranks

    world = 3
    run_ranks(world, record_training_and_resume, tmp_path)
    queues = [pickle.loads((tmp_path / f"calls-{r}.pkl").read_bytes()) for r in range(world)]
    assert Collective("broadcast_object_list", 1) in queues[0]  # the resume came from rank 1's disk
    assert replay(queues) is None


def test_commcheck_times_back_to_back_and_checks_one_more_operation():
    """nccl-tests' convention: `iters` operations between two syncs; the check runs on its own."""
    queues = queues_of(2, lambda rank: comm.measure("all_reduce", rank, 64, CPU, warmup=2, iters=5))
    assert queues[0] == [Collective("all_reduce")] * 2 + [Collective("barrier")] + [Collective("all_reduce")] * (5 + 1)


def test_the_size_column_is_nccl_tests_size():
    rows = comm.summarize([{"rank": r, "timings": [{"primitive": p, "bytes": 64, "seconds": 1e-3}
                                                   for p in ("all_gather", "all_reduce")], "failures": {}}
                           for r in range(4)], 4)
    assert [(row["primitive"], row["bytes"], row["size_bytes"]) for row in rows] == [
        ("all_gather", 64, 256), ("all_reduce", 64, 64)]
