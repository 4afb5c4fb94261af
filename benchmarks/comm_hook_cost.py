"""What DDP's comm timer costs a step: the same DDP training with DDP's built-in all-reduce, with
the timer's hook attached but idle (a step outside the measured windows), and with it recording.

Two ranks under gloo on this machine's CPU (torch.multiprocessing, 127.0.0.1), the pipeline's `small`
model (`pipeline.model.build_model`), Adam, MNIST-shaped random batches making the default global
batch of 128; `--device cuda` runs a rank per GPU over NCCL instead (`make gpu-check` does). Each round builds a fresh DDP per arm (a registered hook stays for good) and
times `--steps` steps after 10 of warm-up, the arms in turn, each first in one round of three. The
table gives each arm's median step over `--repeats` rounds (a round's figure: the slower rank's
median step) and its median ratio to the built-in all-reduce's step in the same round, also as
microseconds a step. #55 item 4: this cost is what the pipeline keeps out of DDP's step times and
steady throughput by giving the hook a window of its own, the last (pipeline.breakdown.Probe).

    .venv/bin/python benchmarks/comm_hook_cost.py [--steps 200] [--repeats 6]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ARMS = ("built-in all-reduce", "timer hook, idle", "timer hook, recording")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_arm(arm: str, steps: int, world: int, device: torch.device) -> float:
    from pipeline.breakdown import CommTimer, StepClock
    from pipeline.model import build_model

    torch.manual_seed(0)
    model = build_model("small").to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    clock = StepClock(device)
    timer = CommTimer(clock, ddp, world) if arm != ARMS[0] else None
    if timer is not None:
        timer.attach()
    generator = torch.Generator().manual_seed(dist.get_rank())
    images = torch.randn(128 // world, 1, 28, 28, generator=generator).to(device)
    labels = torch.randint(0, 10, (128 // world,), generator=generator).to(device)
    times = []
    for step in range(10 + steps):
        if timer is not None:
            timer.step = step if arm == ARMS[2] else None
            timer.calls.clear()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(images), labels).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    # The slower rank's median step: DDP's ranks meet in every all-reduce.
    median = torch.tensor([statistics.median(times[10:])], device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def worker(rank: int, world: int, port: int, steps: int, repeats: int, cuda: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # ranks on cores of their own, as the pipeline's CPU DDP runs them
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        rounds = {arm: [] for arm in ARMS}
        for index in range(repeats):
            for arm in ARMS[index % 3:] + ARMS[:index % 3]:  # each arm first in turn: no place favoured
                rounds[arm].append(run_arm(arm, steps, world, device))
        if rank == 0:  # each arm's median step, and its median ratio to the built-in's of the same round
            results.update({arm: (statistics.median(values),
                                  statistics.median(v / b for v, b in zip(values, rounds[ARMS[0]])))
                            for arm, values in rounds.items()})
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: a rank per GPU over NCCL (make gpu-check)")
    parser.add_argument("--ranks", type=int, default=0, help="0: 2 on the CPU, every GPU (up to 8) on cuda")
    parser.add_argument("--json", type=Path, help="also write the table's figures here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    world = args.ranks or (min(8, torch.cuda.device_count()) if cuda else 2)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(world, free_port(), args.steps, args.repeats, cuda, results), nprocs=world)
        results = dict(results)
    base = results[ARMS[0]][0]
    backend = "NCCL, GPUs" if cuda else "gloo, CPU"
    print(f"\nDDP's comm timer, {world} ranks ({backend}), small model, global batch 128, "
          f"{args.steps} steps, median of {args.repeats}\n")
    print("| arm | median step, ms | vs built-in | per step, us |")
    print("|---|---:|---:|---:|")
    for arm in ARMS:
        step, ratio = results[arm]
        print(f"| {arm} | {step * 1e3:.2f} | {ratio:.3f}x | {(ratio - 1) * base * 1e6:+.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"ranks": world, "device": args.device,
                                         "arms": {arm: {"median_step_s": step, "ratio": ratio}
                                                  for arm, (step, ratio) in results.items()}}))


if __name__ == "__main__":
    main()
