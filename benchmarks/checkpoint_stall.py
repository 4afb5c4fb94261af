"""How long a training stops for a checkpoint, by `train.checkpoint_format` (#56), side by side in
one run: whole (rank 0 gathers the model and optimizer state and writes one file), sharded (each
rank writes its own part) and sharded-async (each rank copies its part and writes it in a thread).

Each rank of an fsdp model (8 square linear layers of `--width`, Adam) makes checkpoints through the
pipeline's own path (pipeline.loop.checkpoint_state, then shards.Writer.commit on rank 0), the
formats in turn, `--repeats` times each. The stall is what a step waits: from the checkpoint's start
until every rank may step on (a barrier, as the loop's step checkpoints end). For sharded-async the
write then goes on behind the training: its end (`written`) is when `Writer.wait` returns. Each
cell is the median over the repeats; the ratio is against whole's stall, measured in the same run.

    .venv/bin/python benchmarks/checkpoint_stall.py [--width 2048] [--ranks 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline import shards  # noqa: E402
from pipeline.checkpoint import CHECKPOINT_FILE  # noqa: E402
from pipeline.config import CHECKPOINT_FORMATS, TrainConfig  # noqa: E402
from pipeline.loop import Training, checkpoint_state  # noqa: E402
from pipeline.optim import build_optimizer, build_schedule  # noqa: E402
from pipeline.parallel import Rank, shard  # noqa: E402
from tests.conftest import free_port  # noqa: E402


def rank_main(r: int, world: int, port: int, width: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=world)
    torch.set_num_threads(1)  # each rank one core, as the loop's DDP share of the cores
    rank, device = Rank(r, r, world, world), torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)])
    wrapped = shard(model, device)
    times: dict[str, list[tuple[float, float]]] = {}
    for fmt in CHECKPOINT_FORMATS:
        config = TrainConfig(checkpoint_format=fmt, epochs=2)
        optimizer = build_optimizer(wrapped.parameters(), config)
        scheduler = build_schedule(optimizer, config, 10)
        wrapped(torch.randn(4, width)).sum().backward()
        optimizer.step()
        folder = Path(out) / fmt
        run = Training(config, "fsdp", rank, device, folder)
        writer = shards.Writer(folder, rank, fmt)
        for repeat in range(repeats + 1):  # the first is a warm-up
            dist.barrier()
            started = time.perf_counter()
            state = checkpoint_state(model, wrapped, optimizer, scheduler, None, 0, [], config, run, writer,
                                     shard_tag=shards.tag(0, repeat))
            if rank.is_main:
                writer.commit(folder / CHECKPOINT_FILE, state)
            dist.barrier()
            stall = time.perf_counter() - started
            writer.wait()
            dist.barrier()
            if repeat:
                times.setdefault(fmt, []).append((stall, time.perf_counter() - started))
    if rank.is_main:
        state_mib = 3 * sum(p.numel() for p in model.parameters()) * 4 / 2**20  # weights and Adam's two moments
        Path(out, "times.json").write_text(json.dumps({"state_mib": state_mib, "times": times}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="checkpoint-stall-") as out:
        mp.start_processes(rank_main, args=(args.ranks, free_port(), args.width, args.repeats, out),
                           nprocs=args.ranks, start_method="spawn")
        result = json.loads(Path(out, "times.json").read_text())
    whole = statistics.median(stall for stall, _ in result["times"]["whole"])
    print(f"fsdp over {args.ranks} ranks (gloo, CPU), model and Adam state {result['state_mib']:.0f} MiB, "
          f"median of {args.repeats}")
    print(f"{'format':<15} {'stall s':>8} {'written s':>10} {'stall / whole':>14}")
    for fmt, times in result["times"].items():
        stall = statistics.median(s for s, _ in times)
        written = statistics.median(w for _, w in times)
        print(f"{fmt:<15} {stall:>8.3f} {written:>10.3f} {stall / whole:>14.2f}")


if __name__ == "__main__":
    main()
