"""train.loader: dataloader: each step's samples read by a torch DataLoader, for data that does not
fit in memory (or on the device).

The loop decides every batch itself (loop.py: the epoch's permutation, each rank's share of each
global batch, the micro-batches), then asks its data for those samples: `feed(parts)` yields
(inputs, targets) for each list of indices in turn. loop.DeviceSplit answers by indexing tensors
already on the device; `Loaded` answers through a DataLoader whose batch sampler is those very
lists, so its workers read exactly the samples the in-memory path gathers, in the same order, and
the modes' weights stay what they are, bit for bit. DistributedSampler is not used: it deals whole
per-rank batches, and cannot deal a global batch that the world size does not divide (loop.py).

Augmentation (a workload's `Samples.augment`) happens here, in the workers: each request names a
sample and the epoch, and the sample's draws are seeded by (train.seed, epoch, index), so which
worker, rank or mode reads it changes nothing, and a resumed epoch draws what the lost one drew.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import random
import signal
import threading
from contextlib import contextmanager
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from pipeline.errors import ConfigError
from pipeline.loop import DeviceSplit, whole_on_device
from pipeline.prepared import OnDisk, normalised
from pipeline.workloads import Samples


class _Requests:
    """The DataLoader's batch sampler: the index lists of the feed in progress. The loader iterates it
    in this process, ahead of the steps by what its workers prefetch."""

    def __init__(self) -> None:
        self.lists: Iterable[list[int]] = ()

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.lists)


class _Collate:
    """default_collate, but an empty list (a rank's empty last micro-batch: loop.micro_batches) gives
    empty tensors of the samples' shape, as indexing a tensor with no index does."""

    def __init__(self, empty: tuple[torch.Tensor, torch.Tensor]):
        self.empty = empty

    def __call__(self, samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        return default_collate(samples) if samples else self.empty


# The notices a rank acts on at a step's end (pipeline.preemption; SIGHUP: the warm server's fork
# takes it as SIGTERM), sent to every process of a job by Slurm, Kubernetes, torchrun's agent and
# the warm client.
NOTICES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def _deaf_to_notices(_worker_id: int) -> None:
    """A worker ignores the notices: dying of one, it would make its rank raise mid-step instead of
    checkpointing at the step's end. It ends when its rank shuts it down, or, should the rank die,
    when DataLoader's watchdog sees its parent gone. The notices were held from its fork (`held`),
    so none reached it before it could ignore them."""
    for notice in NOTICES:
        signal.signal(notice, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, NOTICES)


@contextmanager
def held():
    """Notices wait while workers fork. The children inherit a mask that holds them; this process
    only records one meanwhile (another thread may take it, and the handler would then stop this
    one with a loader half made, its workers out of reach), then acts on it once the loader is
    whole. A loader that fails half made has its new workers killed."""
    seen: list[int] = []
    swapped = {}
    if threading.current_thread() is threading.main_thread():
        for notice in NOTICES:
            if callable(signal.getsignal(notice)):
                swapped[notice] = signal.signal(notice, lambda signum, _frame: seen.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, NOTICES)
    before = set(multiprocessing.active_children())
    try:
        yield
    except BaseException:
        for child in set(multiprocessing.active_children()) - before:
            child.kill()
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for notice, handler in swapped.items():
            signal.signal(notice, handler)
        for notice in dict.fromkeys(seen):
            signal.raise_signal(notice)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation in one epoch: a function of the three alone, so any
    worker, rank or mode that reads the sample draws the same (63 bits, as manual_seed takes)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class _Augmented(Dataset):
    """A dataset whose samples asked for as (index, epoch) are augmented, under torch's CPU
    generator and Python's `random` seeded for that sample and epoch, then put back as they were
    (the rank's dropout draws, where the loader reads in this process, are untouched); an index
    alone gives the sample as it is."""

    def __init__(self, dataset: Dataset, augment: Callable[[torch.Tensor], torch.Tensor], seed: int):
        self.dataset, self.augment, self.seed = dataset, augment, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        if not isinstance(key, tuple):
            return self.dataset[key]
        index, epoch = key
        inputs, target = self.dataset[index]
        seed = sample_seed(self.seed, epoch, index)
        python_state = random.getstate()
        # The CPU's generator alone: torch.manual_seed would reseed every GPU's too, which a loader
        # reading in the training process (loader_workers: 0) must leave to dropout.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            random.seed(seed)  # torchvision's RandomChoice and RandomOrder draw from Python's
            try:
                return self.augment(inputs), target
            finally:
                random.setstate(python_state)


def _shut_down(loader: DataLoader) -> None:
    """Persistent workers outlive each epoch's iteration; ignoring SIGTERM, they would also outlive
    multiprocessing's terminate() at exit, which then waits on them forever."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is None or not hasattr(iterator, "_shutdown_workers"):
        return
    iterator._shutdown_workers()  # asks each to end, and waits for it a while
    for worker in getattr(iterator, "_workers", ()):
        if worker.is_alive():
            worker.kill()
            worker.join()
    loader._iterator = None


class Loaded:
    """A map-style Dataset of (input, target) samples, read by `workers` processes as the steps need
    them (0: in this process), each batch moved to `device` (pinned first on GPUs, so the copy is
    asynchronous), then `on_device` applied to its inputs there. `augment`: each sample's input, as
    a training epoch reads it, goes through it under torch's generator seeded by (`seed`, the epoch,
    the sample's index); the request carries the epoch to the worker, so persistent workers augment
    each epoch anew. The workers persist from epoch to epoch, and end with `close()` or at exit."""

    def __init__(self, dataset: Dataset, device: torch.device, workers: int, channels_last: bool = False,
                 on_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 augment: Callable[[torch.Tensor], torch.Tensor] | None = None, seed: int = 0):
        self.dataset, self.device, self.channels_last, self.on_device = dataset, device, channels_last, on_device
        self.augmented = augment is not None
        sample = default_collate([dataset[0]])
        self._requests = _Requests()
        self._loader = DataLoader(
            _Augmented(dataset, augment, seed) if augment is not None else dataset, batch_sampler=self._requests,
            num_workers=workers,
            collate_fn=_Collate(tuple(tensor[:0] for tensor in sample)),
            pin_memory=device.type == "cuda", persistent_workers=workers > 0,
            # Forked from the rank itself: a rank forked from a fork server would otherwise start
            # another, whose workers re-import torch and outlive a rank that dies.
            multiprocessing_context="fork" if workers else None, worker_init_fn=_deaf_to_notices,
            # Each iterator draws its workers' base seed from this generator: from the global one it
            # would shift the dropout's draws (and a resumed epoch's) off the in-memory path's.
            generator=torch.Generator().manual_seed(0))
        # The workers shut down when this is dropped or closed, or else at exit: multiprocessing runs
        # its finalizers before it terminates its children, in a process it started too (a DDP rank
        # of the fork server), where no atexit hook runs.
        self.close = Finalize(self, _shut_down, args=(self._loader,), exitpriority=10)

    # The indices stay on the CPU: the workers read them there.
    index_device = torch.device("cpu")

    def __len__(self) -> int:
        return len(self.dataset)

    def sample_input(self) -> torch.Tensor:
        """The first sample's input, as a batch of one on the device."""
        return self._moved(*default_collate([self.dataset[0]]))[0]

    def feed(self, parts: Iterable[torch.Tensor],
             epoch: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) of each list of indices in turn; `epoch`: the training epoch they are
        for, which augments them (None: evaluation, as they are)."""
        if self.augmented and epoch is not None:
            self._requests.lists = ([(index, epoch) for index in part.tolist()] for part in parts)
        else:
            self._requests.lists = (part.tolist() for part in parts)
        with held():  # the first iteration forks the workers
            batches = iter(self._loader)
        for inputs, targets in batches:
            yield self._moved(inputs, targets)

    def _moved(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.to(self.device, non_blocking=True)
        if self.on_device is not None:
            inputs = self.on_device(inputs)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets.to(self.device, non_blocking=True)


def split_of(samples: Samples, device: torch.device, loader: str, workers: int,
             channels_last: bool = False, seed: int | None = None) -> DeviceSplit | Loaded:
    """A workload's split as the loop and `evaluate` take it (train.loader): on the device whole
    ("memory"), or read by a DataLoader as the batches need it ("dataloader"). Either way its inputs
    go through the workload's `on_device` there. `seed`: the training split's train.seed, which seeds
    its augmentation (a DataLoader's alone); other splits are read as they are. Close it when done
    (the DataLoader's workers end)."""
    augment = samples.augment if seed is not None else None
    if loader == "dataloader":
        return Loaded(samples.dataset, device, workers, channels_last, on_device=samples.on_device,
                      augment=augment, seed=seed or 0)
    if augment is not None:
        raise ConfigError(AUGMENTED_IN_MEMORY)
    return whole_on_device(*whole(samples.dataset), device, samples.on_device, channels_last)


AUGMENTED_IN_MEMORY = ("train.loader = memory, but the workload augments its training samples, anew every epoch, "
                       "which only a DataLoader does: set train.loader: dataloader")


def whole(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample of `dataset` as (inputs, targets): its `tensors` where it has them (a
    TensorDataset, MNIST's prepared files), else each sample read once and stacked."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None:
        return tensors[0], tensors[1]
    inputs, targets = default_collate([dataset[i] for i in range(len(dataset))])
    return inputs, targets


def prepared_split(data_dir: Path, name: str, mean: float, std: float, device: torch.device, loader: str,
                   workers: int, channels_last: bool = False) -> DeviceSplit | Loaded:
    """A prepared MNIST split (the benchmarks' way in), normalised with `mean` and `std`."""
    return split_of(Samples(OnDisk(data_dir, name), functools.partial(normalised, mean=mean, std=std)), device,
                    loader, workers, channels_last)
