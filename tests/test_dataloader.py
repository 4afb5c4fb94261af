"""train.loader: dataloader (#53): a torch DataLoader reads each step's samples from the prepared
file, memory-mapped, in worker processes, and hands the loop exactly what the in-memory path
gathers, in the same order, so a training is the in-memory one bit for bit. Here: the feed itself,
and a whole training in this process (dropout and micro-batches included). The stage's path, at 3
DDP ranks under torchrun with a mid-epoch crash and restart, is tests/test_train_modes.py's
odd-world-size resume, whose restarted training reads through a DataLoader; the preempted one of
tests/test_preemption.py reads through one too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pipeline.batches import Loaded
from pipeline.evaluation import evaluate_model
from pipeline.loop import Training, micro_batches, rank_share, to_device, train
from pipeline.parallel import Rank
from pipeline.prepared import OnDisk, Split, normalised
from tests.ddp_harness import CLASSIC, equal, learnable_data, train_config

MEAN, STD = 0.4, 0.3


def prepared(folder: Path, name: str, n: int, seed: int) -> Split:
    """A prepared split on disk as `prepare` writes one: uint8 pixels (a label to learn), int64 labels."""
    data = learnable_data(n, seed)
    split = Split((data.images[:, 0] * 255).to(torch.uint8), data.labels)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"images": split.images, "labels": split.labels}, folder / f"{name}.pt")
    return split


@pytest.mark.fast
@pytest.mark.parametrize("workers", [0, 2])
def test_the_dataloader_feeds_what_indexing_the_split_on_the_device_gives(tmp_path, workers):
    split = prepared(tmp_path, "train", 300, 0)
    in_memory = to_device(split, MEAN, STD, torch.device("cpu"))
    on_disk = OnDisk(tmp_path, "train")
    assert len(on_disk) == 300 and torch.equal(on_disk[7][0], split.images[7]) and on_disk[7][0].dtype == torch.uint8
    order = torch.randperm(300, generator=torch.Generator().manual_seed(1))
    # Rank 1 of 3's micro-batches of two global batches, a last part left empty, then the epoch's short last batch.
    parts = [*micro_batches(rank_share(order[:100], Rank(1, 1, 3, 3)), 4),
             *micro_batches(torch.arange(2), 3), order[290:]]
    assert len(parts[-2]) == 0
    rng = torch.get_rng_state()
    loaded = Loaded(on_disk, torch.device("cpu"), workers, on_device=lambda images: normalised(images, MEAN, STD))
    read = list(loaded.feed(iter(parts)))
    loaded.close()
    # Its workers' seed comes from a generator of its own: dropout's draws stay the in-memory path's.
    assert torch.equal(torch.get_rng_state(), rng)
    gathered = list(in_memory.feed(parts))
    assert len(read) == len(gathered) == len(parts)
    for (images, labels), (want_images, want_labels) in zip(read, gathered):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
        assert images.shape == want_images.shape and labels.dtype == want_labels.dtype


@pytest.mark.fast
def test_the_workers_outlast_a_preemption_notice_sent_to_every_process_of_the_job(tmp_path):
    """Slurm, Kubernetes and torchrun's agent signal every process of a job; the rank checkpoints at
    the step's end (pipeline.preemption), so its workers must go on reading meanwhile, not die and
    make it raise mid-step."""
    import multiprocessing
    import os
    import signal

    split = prepared(tmp_path, "train", 64, 0)
    loaded = Loaded(OnDisk(tmp_path, "train"), torch.device("cpu"), workers=2)
    before = set(multiprocessing.active_children())
    feed = loaded.feed(iter(torch.arange(64).split(8)))
    first = next(feed)
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2
    for worker in workers:  # one may still be starting: the notices wait for it to ignore them
        for notice in (signal.SIGTERM, signal.SIGUSR1):
            os.kill(worker.pid, notice)
    rest = list(feed)
    assert torch.equal(torch.cat([first[0], *(images for images, _ in rest)]), split.images)
    assert all(worker.is_alive() for worker in workers)
    loaded.close()
    assert not any(worker.is_alive() for worker in workers)


@pytest.mark.fast
def test_a_notice_while_workers_fork_waits_for_the_loader_and_a_half_made_one_leaves_no_worker():
    import multiprocessing
    import os
    import signal
    import time

    from pipeline.batches import held

    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: seen.append(signum))
    try:
        with held():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            assert seen == []  # recorded, not acted on: a handler that stops would stop a half-made loader
        assert seen == [signal.SIGUSR1]  # acted on once the loader is whole
        with pytest.raises(RuntimeError, match="half made"):
            with held():
                child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
                child.start()
                raise RuntimeError("half made")
        child.join(timeout=10)
        assert not child.is_alive()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_training_read_by_a_dataloader_is_the_in_memory_training_bit_for_bit(tmp_path):
    """Two epochs of the loop with dropout (classic) and micro-batches, their validation included:
    the same weights and the same epoch metrics from either source; then `evaluate`'s numbers for
    the model, the same from either."""
    config = dataclasses.replace(train_config(batch_size=40, epochs=2), grad_accum_steps=2,
                                 eval_batch_size=16)
    splits = {name: prepared(tmp_path / "data", name, n, seed) for name, n, seed in (("train", 300, 0), ("val", 50, 1))}
    cpu = torch.device("cpu")
    sources = {
        "memory": [to_device(split, MEAN, STD, cpu) for split in splits.values()],
        "dataloader": [Loaded(OnDisk(tmp_path / "data", name), cpu, workers=2,
                              on_device=lambda images: normalised(images, MEAN, STD)) for name in splits],
    }
    trained = {}
    for loader, (train_data, val_data) in sources.items():
        run = Training(dataclasses.replace(config, loader=loader), "single", Rank(), cpu, tmp_path / loader,
                       workload=CLASSIC)
        trained[loader] = train(run, train_data, val_data)
    evaluations = {loader: evaluate_model(trained["memory"][0], val_data, 16)
                   for loader, (_, val_data) in sources.items()}
    for source in sources["dataloader"]:
        source.close()
    (memory, memory_history), (loaded, loaded_history) = trained["memory"], trained["dataloader"]
    assert equal(memory.state_dict(), loaded.state_dict())
    for ours, theirs in zip(memory_history, loaded_history):
        for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "loss_windows"):
            assert ours[key] == theirs[key], key
    assert memory_history[1]["train_loss"] < memory_history[0]["train_loss"]  # it trained
    ours, theirs = evaluations["memory"], evaluations["dataloader"]
    assert ours.summary() == theirs.summary() and torch.equal(ours.predictions, theirs.predictions)
    assert ours.summary()["count"] == 50
