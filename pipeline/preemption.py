"""A preemption notice becomes a checkpoint at the next step, then a stop.

Schedulers warn before they take a node back: Kubernetes sends SIGTERM and waits out the pod's
grace period (30 s by default), Slurm sends SIGTERM before its SIGKILL (GraceTime), or a signal of
the job's choosing ahead of time to the batch script (`sbatch --signal=B:USR1@120`, which
deploy/slurm/train.sbatch passes on as SIGTERM: a USR1 of its own would kill torchrun's agent), and
torchrun passes a SIGTERM on to its workers and gives them 30 s. A USR1 sent to a worker itself
counts too. With step checkpoints on (train.checkpoint_every_steps), the
training takes the notice rather than dying where it stands: every rank stops after the same step,
the checkpoint is written, and the process ends as the signal would have ended it (exit 128 +
signal), so that a resume (a restarted worker, `--resume`, `dvc repro`) goes on from the next step
in the same MLflow runs.

The ranks agree on that step without a wait of their own: each step's end starts an all-reduce
(MAX) of "a notice arrived" over a CPU (gloo) group and reads the one started a step before. Every
rank reads the same answer after the same step, one step late, and no GPU waits for it.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.parallel import PROCESS_GROUP_TIMEOUT, Rank

NOTICES = (signal.SIGTERM, signal.SIGUSR1)
# Set by deploy/slurm/train.sbatch: the file rank 0 writes when the training stopped for a notice,
# so that the job requeues itself only then (not after a training that had finished anyway).
STOPPED_FILE_ENV = "MNIST_PIPELINE_STOPPED_FILE"


class Notice:
    """While entered (in the main thread), SIGTERM and SIGUSR1 are noted, not acted on; `agreed()`
    at each step's end says which one every rank has seen by then (0: none)."""

    def __init__(self, rank: Rank):
        self.signum = 0
        # Its own group: a CPU tensor under NCCL too, and its collectives never queue behind DDP's.
        self.group = dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT) if rank.world_size > 1 else None
        self.in_flight: tuple[torch.Tensor, dist.Work] | None = None
        self.previous: dict[int, object] = {}

    def __enter__(self) -> "Notice":
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._note) for sig in NOTICES}
        return self

    def __exit__(self, kind, exc, tb) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if kind is None and self.in_flight is not None:  # every rank started it: every rank ends it
            self.in_flight[1].wait()

    def _note(self, signum: int, _frame) -> None:
        self.signum = self.signum or signum

    def agreed(self) -> int:
        """The notice (a signal number) every rank is to stop for after this step; 0 to go on."""
        if self.group is None:
            return self.signum
        decided = 0
        if self.in_flight is not None:
            flag, work = self.in_flight
            work.wait()
            decided = int(flag.item())
        flag = torch.tensor([self.signum], dtype=torch.int32)
        self.in_flight = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return decided


def say_stopped(what: str) -> None:
    """On rank 0, once the checkpoint is whole: tell the batch script that the training stopped for
    a notice and can go on from there (STOPPED_FILE_ENV; nothing without it)."""
    path = os.environ.get(STOPPED_FILE_ENV)
    if path:
        Path(path).write_text(what + "\n")
