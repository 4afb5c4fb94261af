"""DDP ranks in real processes over gloo, running the pipeline's own loop (only the launcher is
left out), on small synthetic data that a model can learn; and a training stopped in-process after
its first epoch, to resume from its checkpoint."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.config import TrainConfig, WorkloadConfig
from pipeline.loop import DeviceSplit, Training, train
from pipeline.parallel import Rank
from tests import zygote
from tests.conftest import free_port


def learnable_data(n: int, seed: int = 0) -> DeviceSplit:
    """Images with a learnable label (which quarter is brightest), so training moves the weights."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 1, 28, 28, generator=generator)
    quarters = images.reshape(n, 2, 14, 2, 14).mean((2, 4)).flatten(1)
    return DeviceSplit(images, quarters.argmax(1))


def train_config(batch_size: int, epochs: int = 1) -> TrainConfig:
    return TrainConfig(modes=("single", "ddp"), batch_size=batch_size, epochs=epochs, lr=0.02, eval_batch_size=64)


# MNIST's network with dropout: what a test of random draws (dropout) trains (Training's workload).
CLASSIC = WorkloadConfig(init_args={"model": "classic", "label_smoothing": 0.1})


def _rank_main(r: int, world: int, port: int, body: Callable, args: tuple, env: dict[str, str]) -> None:
    os.environ.clear()  # the test's environment now, not the fork server's when it started
    os.environ.update(env)
    torch.set_num_threads(1)  # the ranks share the machine's cores, as limit_cpu_threads makes them
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=world)
    try:
        body(r, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, body: Callable, *args) -> None:
    """`body(rank, world, *args)` in `world` processes of their own joined in one gloo group; `body`
    must be a module-level function, and writes what it returns to a file."""
    mp.start_processes(_rank_main, args=(world, free_port(), body, args, dict(os.environ)), nprocs=world,
                       start_method=start_method())


# The ranks are forks of one server per test worker that imported torch and the pipeline once
# (multiprocessing's fork server, as the pipeline starts its own DDP workers), not fresh
# interpreters that each import them (#52: most of a rank's CPU on the tests' small data). Each
# takes the test's environment as it starts; where the test has changed what those imports read
# of it since the server started (tests/zygote.py: imports_see), they are spawned afresh.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "tests.ddp_harness"]
_SERVER_SAW: frozenset | None = None


def start_method() -> str:
    global _SERVER_SAW
    if os.environ.get(zygote.ZYGOTE_ENV) == "0" or sys.platform != "linux":
        return "spawn"
    seen = zygote.imports_see(dict(os.environ))
    if _SERVER_SAW is None:  # the server starts at the first start_processes, with this environment
        multiprocessing.set_forkserver_preload(PRELOAD)
        _SERVER_SAW = seen
    return "forkserver" if seen == _SERVER_SAW else "spawn"


def rank_dir(out: Path, r: int) -> Path:
    """A folder of rank r's own: its node's disk."""
    folder = out / f"rank-{r}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def train_each(r: int, world: int, configs: list[TrainConfig], train_split: DeviceSplit, val_split: DeviceSplit,
               out: Path, mode: str = "ddp") -> None:
    """Rank r of a DDP (or `mode`) training under each config in turn; rank 0 saves config i's
    weights and history to out/<i>.pt. (The loop raises if the ranks' weights ever differ.)"""
    for i, cfg in enumerate(configs):
        run = Training(cfg, mode, Rank(r, r, world, world), torch.device("cpu"), rank_dir(out / str(i), r))
        model, history = train(run, train_split, val_split)
        if r == 0:
            torch.save({"weights": model.state_dict(), "history": history}, out / f"{i}.pt")


class Interrupted(Exception):
    pass


def stop_after_first_epoch(metrics: dict, _rank_metrics: dict) -> None:
    """An epoch hook: the training stops once its first epoch's checkpoint is written, as a
    preemption then would, losing nothing."""
    if metrics["epoch"] == 1:
        raise Interrupted


def equal(a: dict, b: dict) -> bool:
    """Two state dicts hold the same tensors, bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
