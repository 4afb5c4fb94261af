"""Training throughput: this project's loop against a conventional PyTorch MNIST loop.

Both train the same model (the workload's, MNIST's network from params.yaml) with the same optimiser and global batch,
for the same number of steps from a cold start, on the same slice of real MNIST:

- conventional: torchvision's MNIST dataset, ToTensor + Normalize per sample, a DataLoader
  (num_workers=0: on a small CPU box workers only compete with training for the cores), and a
  DistributedSampler under DDP;
- ours: `pipeline.loop.train`, the code the train stage runs, with the data on the device (train.loader:
  memory) and read from the prepared file by a DataLoader (dataloader, train.loader_workers workers a
  process, or --loader-workers).

Each runs as single (1 process x all cores) and ddp (N gloo processes x 1 thread), then the
default training runs in full and its test accuracy is measured, for time-to-accuracy.

    MNIST_SOURCE=../shared/data/mnist .venv/bin/python benchmarks/train_throughput.py
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import malloc, mnist, parallel  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.batches import prepared_split  # noqa: E402
from pipeline.loop import Training, evaluate, to_device, train  # noqa: E402
from pipeline.workloads import load_workload  # noqa: E402
from pipeline.prepared import Split  # noqa: E402

import mnist_data  # noqa: E402  (benchmarks/, this script's folder)


def torchvision_root(source: Path, dest: Path) -> Path:
    """Lay out MNIST_SOURCE the way torchvision.datasets.MNIST expects (uncompressed, MNIST/raw)."""
    raw = dest / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in mnist.CANONICAL_MD5:
        path = mnist.find_idx_file(source, name)
        with (gzip.open(path) if path.suffix == ".gz" else open(path, "rb")) as src, open(raw / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return dest


def conventional(rank: parallel.Rank, config, workload, root: Path, steps: int, mean: float, std: float) -> float:
    from torch.utils.data import DataLoader, Subset
    from torch.utils.data.distributed import DistributedSampler
    from torchvision import datasets, transforms

    dataset = datasets.MNIST(str(root), train=True, transform=transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((mean,), (std,))]))
    dataset = Subset(dataset, range(steps * config.batch_size))
    if config.batch_size % rank.world_size:  # DistributedSampler's per-rank batch: only an even split keeps the global one
        raise SystemExit(f"the conventional loop needs train.batch_size ({config.batch_size}) divisible by "
                         f"{rank.world_size} ranks")
    batch = config.batch_size // rank.world_size
    if rank.world_size > 1:
        sampler = DistributedSampler(dataset, rank.world_size, rank.rank, shuffle=True, seed=config.seed)
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=0)
    else:
        loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=0)
    torch.manual_seed(config.seed)
    model = load_workload(workload).build_model()
    wrapped = parallel.wrap(model, "ddp" if rank.world_size > 1 else "single", torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    started = time.perf_counter()
    for images, labels in loader:
        loss = torch.nn.functional.cross_entropy(wrapped(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    elapsed = max(parallel.all_gather_objects(time.perf_counter() - started, rank))
    return steps * config.batch_size / elapsed


def ours(rank: parallel.Rank, config, workload, train_split: Split, val_split: Split, mean: float, std: float,
         out: Path) -> float:
    device = torch.device("cpu")
    run = Training(replace(config, epochs=1), "ddp" if rank.world_size > 1 else "single", rank, device, out,
                   workload=workload)
    _, history = train(run, to_device(train_split, mean, std, device), to_device(val_split, mean, std, device))
    return history[-1]["samples_per_s"]


def ours_loaded(rank: parallel.Rank, config, workload, data_dir: Path, mean: float, std: float, out: Path) -> float:
    device = torch.device("cpu")
    run = Training(replace(config, epochs=1, loader="dataloader"), "ddp" if rank.world_size > 1 else "single", rank,
                   device, out, workload=workload)
    train_data, val_data = (prepared_split(data_dir, name, mean, std, device, "dataloader", config.loader_workers)
                            for name in ("train", "val"))
    _, history = train(run, train_data, val_data)
    train_data.close(), val_data.close()
    return history[-1]["samples_per_s"]


def full_default_run(rank: parallel.Rank, config, workload, splits: dict[str, Split], mean: float, std: float,
                     out: Path) -> tuple[float, float]:
    device = torch.device("cpu")
    data = {name: to_device(split, mean, std, device) for name, split in splits.items()}
    mode = "ddp" if rank.world_size > 1 else "single"
    model, history = train(Training(config, mode, rank, device, out, workload=workload), data["train"], data["val"])
    sums = evaluate(model, data["test"], torch.arange(len(data["test"])), config.eval_batch_size,
                    workload=load_workload(workload))
    return sum(m["train_time_s"] for m in history), (sums["accuracy"] / sums["count"]).item()


def worker(local_rank: int, world_size: int, port: int, job: str, args: tuple, results) -> None:
    if world_size > 1:
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank = parallel.rank_from_env()
    malloc.keep_freed_memory()  # as in every mnist-pipeline process (stages/cli.py), for both loops alike
    torch.set_num_threads(max(1, parallel.available_cpus() // world_size))
    job_fn = {"conventional": conventional, "ours": ours, "ours_loaded": ours_loaded, "full": full_default_run}[job]
    if world_size == 1:
        results.put(job_fn(rank, *args))
        return
    with parallel.process_group(rank, torch.device("cpu")):
        value = job_fn(rank, *args)
    if rank.is_main:
        results.put(value)


def measure(job: str, world_size: int, *args):
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(worker, args=(world_size, port, job, args, results), nprocs=world_size,
                       start_method="spawn", join=True)
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per throughput measurement")
    parser.add_argument("--ranks", type=int, default=2, help="DDP processes (1 thread each)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per setup; the median counts")
    parser.add_argument("--params", default=str(ROOT / "params.yaml"))
    parser.add_argument("--loader-workers", type=int, help="DataLoader workers a process (default: params.yaml's)")
    parser.add_argument("--no-full", action="store_true", help="throughput only, not the default training")
    args = parser.parse_args()
    config = load_config(args.params)
    if args.loader_workers is not None:
        config = replace(config, train=replace(config.train, loader_workers=args.loader_workers))
    data, mean, std = mnist_data.splits(config.data)
    train_split, val_split, test = data["train"], data["val"], data["test"]
    n = args.steps * config.train.batch_size
    bench_train = Split(train_split.images[:n], train_split.labels[:n])
    tiny_val = Split(val_split.images[:500], val_split.labels[:500])
    cpus = parallel.available_cpus()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = torchvision_root(mnist_data.source(), tmp / "torchvision")
        prepared = tmp / "prepared"  # the same slices as `prepare` writes them, for the DataLoader to read
        prepared.mkdir()
        for name, split in (("train", bench_train), ("val", tiny_val)):
            torch.save({"images": split.images.contiguous(), "labels": split.labels}, prepared / f"{name}.pt")
        rows = []
        for label, world in ((f"single (1x{cpus})", 1), (f"ddp ({args.ranks}x1)", args.ranks)):
            conv, our, loaded = [], [], []
            for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits all three
                conv.append(measure("conventional", world, config.train, config.workload, root, args.steps, mean, std))
                our.append(measure("ours", world, config.train, config.workload, bench_train, tiny_val, mean, std,
                                   tmp / f"ours-{world}"))
                loaded.append(measure("ours_loaded", world, config.train, config.workload, prepared, mean, std,
                                      tmp / f"loaded-{world}"))
            rows.append((label, statistics.median(conv), statistics.median(our), statistics.median(loaded)))
        full = {}
        for label, world in ((f"single (1x{cpus})", 1), (f"ddp ({args.ranks}x1)", args.ranks)):
            if args.no_full:
                break
            full[label] = measure("full", world, config.train, config.workload, {"train": train_split, "val": val_split, "test": test},
                                  mean, std, tmp / f"full-{world}")

    print(f"\nTraining throughput, samples/s (median of {args.repeats} x {args.steps} steps, global batch "
          f"{config.train.batch_size}, model {config.workload.init_args.get('model')}, {cpus} CPU cores)\n")
    print(f"| setup | conventional | ours | ours, DataLoader ({config.train.loader_workers} workers) | "
          "ours / conventional | DataLoader / conventional |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, conv, our, loaded in rows:
        print(f"| {label} | {conv:,.0f} | {our:,.0f} | {loaded:,.0f} | {our / conv:.2f}x | {loaded / conv:.2f}x |")
    single_ours, ddp_ours = rows[0][2], rows[1][2]
    print(f"\nddp / single, our loop: {ddp_ours / single_ours:.2f}x")
    if not full:
        return
    print(f"\nDefault training ({config.train.epochs} epochs, params.yaml), then the 10,000 test images:\n")
    print("| setup | training time, s | test accuracy |")
    print("|---|---:|---:|")
    for label, (seconds, accuracy) in full.items():
        print(f"| {label} | {seconds:.1f} | {accuracy:.2%} |")


if __name__ == "__main__":
    main()
