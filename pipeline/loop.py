"""One training loop for every mode.

The data lives on the device as one normalised tensor and batches are gathered by index, so a
step does no per-sample Python work; or (train.loader: dataloader) a DataLoader reads the same
samples from disk as the steps need them (pipeline.batches).

Every mode walks the same global batches: a permutation seeded by (seed + epoch), as
DistributedSampler's `set_epoch` seeds it, cut into batches of `batch_size` (the last one shorter).
A DDP rank r of W takes positions r, r + W, r + 2W, ... of each global batch, so the shares differ
by at most one sample at any world size. Where W divides the batch this is exactly what
DistributedSampler with a per-rank batch of B/W yields; where it does not, DistributedSampler could
not give the same global batches at all. Each rank's loss is the sum of its per-sample losses
divided by L/W (L: the global batch's length), so DDP's average of the ranks' gradients, their sum
over W, is the single-device gradient of the batch's mean loss, whatever the shares.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from pipeline.breakdown import Probe, timeline
from pipeline import gloo_batchnorm, hostload, shards
from pipeline.checkpoint import CHECKPOINT_FILE, check_schedule_length, other_world, trajectory
from pipeline.compiled import check_can_compile, compile_forwards, eager, graphs_compiled, uncompile
from pipeline.config import TrainConfig, WorkloadConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.optim import build_optimizer, build_schedule
from pipeline.parallel import (
    Rank,
    all_gather_objects,
    broadcast_buffers,
    broadcast_object,
    dp_device_count,
    check_world_size,
    full_state_dict,
    gradient_sync_held,
    nodes,
    restarted,
    shard_units,
    sharded,
    unwrap,
    wrap,
)
from pipeline.precision import autocast_dtype, grad_scaler, with_autocast
from pipeline.preemption import Notice, say_stopped
from pipeline.prepared import Split, normalised
from pipeline.workloads import Workload, default_workload, load_workload, score_names

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceSplit:
    """A split in memory, on the device: the loop's data (batches.Loaded reads it from disk instead)."""

    images: torch.Tensor  # the inputs, after the workload's on_device (MNIST: float32 [N, 1, 28, 28]), on the device
    labels: torch.Tensor  # the targets (MNIST: int64 [N]), on the device

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def index_device(self) -> torch.device:  # where the indices that gather a batch go
        return self.labels.device

    def sample_input(self) -> torch.Tensor:
        return self.images[:1]

    def feed(self, parts: Iterable[torch.Tensor],
             epoch: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) of each list of indices in turn, gathered as each is asked for. `epoch`:
        the training epoch they are for (None: evaluation); a split in memory is never augmented."""
        for idx in parts:
            yield self.images[idx], self.labels[idx]

    def close(self) -> None:
        """Nothing to release (a batches.Loaded ends its workers)."""


# What the loop trains on: a DeviceSplit or a batches.Loaded, which answer alike.
Data = Any


def to_device(split: Split, mean: float, std: float, device: torch.device, channels_last: bool = False) -> DeviceSplit:
    """MNIST's uint8 images moved once, then normalised on the device (4x less to copy than floats)."""
    return whole_on_device(split.images, split.labels, device, lambda images: normalised(images, mean, std),
                           channels_last)


def whole_on_device(inputs: torch.Tensor, targets: torch.Tensor, device: torch.device,
                    on_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    channels_last: bool = False) -> DeviceSplit:
    """A split moved whole as it is stored, then `on_device` applied to its inputs there."""
    inputs = inputs.to(device, non_blocking=True)
    if on_device is not None:
        inputs = on_device(inputs)
    if channels_last and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return DeviceSplit(inputs, targets.to(device, non_blocking=True))


def epoch_order(n: int, epoch: int, seed: int) -> torch.Tensor:
    """Every sample once, in `epoch`'s order: the permutation DistributedSampler(shuffle=True)
    draws after set_epoch(epoch), the same on every rank and in every mode."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def global_batches(order: torch.Tensor, global_batch: int) -> tuple[torch.Tensor, ...]:
    """The epoch's global batches, the last one shorter when the batch does not divide the data."""
    return order.split(global_batch)


def rank_share(batch: torch.Tensor, rank: Rank) -> torch.Tensor:
    """Rank r's samples of a global batch: every W-th from position r (parallel.batch_shares)."""
    return batch[rank.rank :: rank.world_size]


def steps_per_epoch(n: int, global_batch: int) -> int:
    return math.ceil(n / global_batch)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def weight_checksum(module: nn.Module) -> float:
    """A position-sensitive float64 fingerprint of the weights: equal on ranks that are in sync
    (fsdp's whole weights, gathered: a collective then)."""
    flat = torch.cat([p.detach().double().flatten().cpu() for p in full_parameters(module)])
    return float((flat * torch.linspace(1.0, 2.0, len(flat), dtype=torch.float64)).sum())


def full_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The parameters as whole tensors: fsdp's shards gathered (every rank calls it, in order)."""
    from torch.distributed.tensor import DTensor

    return [p.full_tensor() if isinstance(p, DTensor) else p for p in module.parameters()]


def state_mb(wrapped: nn.Module, optimizer) -> float:
    """This rank's tensor bytes, in MiB, of its parameters, gradients and optimizer state: all of
    each in ddp (a whole copy on every rank), 1/W of each in fsdp (its shards: what sharding buys)."""
    from torch.distributed.tensor import DTensor

    def nbytes(tensor: torch.Tensor) -> int:
        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).nbytes

    parameters = list(wrapped.parameters())
    total = sum(nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0) for p in parameters)
    total += sum(nbytes(value) for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value))
    return total / 2**20


def zero_scores(names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """float64 running sums of the workload's metrics (exact for counts), one per name."""
    return {name: torch.zeros((), dtype=torch.float64, device=device) for name in names}


def add_scores(sums: dict[str, torch.Tensor], scores: dict[str, torch.Tensor]) -> None:
    """Adds a batch's summed scores into the running sums: every rank sums the same names, in the
    same order, or their all_reduce would mix them up."""
    if scores.keys() != sums.keys():
        raise PipelineError(f"the workload's metrics() named {sorted(scores)} on a batch and {sorted(sums)} on its "
                            "example batch: it must name the same scores for every batch")
    for name, value in scores.items():
        sums[name] += value


def stacked(sums: dict[str, torch.Tensor], names: list[str], device: torch.device) -> torch.Tensor:
    return torch.stack([sums[name] for name in names]) if names else torch.zeros(0, dtype=torch.float64, device=device)


@torch.no_grad()
def evaluate(module: nn.Module, data: Data, indices: torch.Tensor, batch_size: int,
             device: torch.device | None = None, workload: Workload | None = None,
             names: list[str] | None = None, batches: int | None = None) -> dict[str, torch.Tensor]:
    """Sums over `indices` of the workload's evaluation loss ("loss"), of each of its metrics, and
    the count ("count"), float64, on `device` (by default the in-memory data's), in that order: the
    same names on every rank, those with no sample to score included, ready for one all_reduce.
    `names`: the metrics' (score_names; by default read here). `batches`: in that many batches of
    at most `batch_size` (fsdp: every rank must run as many forwards, each gathers the weights)."""
    workload = workload or default_workload()
    device = device or data.index_device
    scores = zero_scores(names if names is not None else score_names(workload, module, device), device)
    loss, count = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
    was_training = module.training
    module.eval()
    indices = indices.to(data.index_device)
    for inputs, targets in data.feed(indices.split(batch_size) if batches is None else indices.tensor_split(batches)):
        outputs = module(inputs).float()  # in float32 whatever the autocast: what the loss and scores read
        loss += workload.eval_loss(outputs, targets)
        add_scores(scores, workload.metrics(outputs, targets))
        count += len(targets)
    module.train(was_training)
    return {"loss": loss, **scores, "count": count}


def all_sum(values: torch.Tensor, rank: Rank) -> torch.Tensor:
    if rank.world_size > 1:
        # gloo and NCCL both reduce float64; the sums stay exact for counts.
        dist.all_reduce(values)
    return values


@dataclass
class Training:
    """What a training run needs, beyond the data; built once by the stage."""

    config: TrainConfig
    mode: str
    rank: Rank
    device: torch.device
    out_dir: Path
    # A checkpoint to continue from (checkpoint.load_checkpoint), or None to start afresh.
    resume_state: dict[str, Any] | None = None
    # Called on every rank after each epoch with (global metrics, this rank's metrics).
    epoch_hooks: list[Callable[[dict, dict], None]] = field(default_factory=list)
    # Small values carried in the checkpoint (tracking run ids), so a resume continues them.
    extra_state: dict[str, Any] = field(default_factory=dict)
    # 0: nothing per step; N: keep this rank's loss every N steps, reported with the epoch.
    log_every_n_steps: int = 0
    # What trains (params.yaml's workload section): its model, loss and metrics.
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)


def build(config: TrainConfig, steps: int, device: torch.device, workload: Workload | None = None):
    """The workload's bare model (by default MNIST's) with its optimizer and schedule; `wrap_for_mode`
    wraps it once any saved state is loaded, so DDP's first broadcast already sends the resumed weights."""
    torch.manual_seed(config.seed)  # identical initial weights on every rank and in every mode
    model = (workload or default_workload()).build_model().to(device)
    if device.type == "cuda" and config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model.parameters(), config)
    scheduler = build_schedule(optimizer, config, steps)
    return model, optimizer, scheduler


def wrap_for_mode(model: nn.Module, config: TrainConfig, device: torch.device, mode: str,
                  nodes: int = 1) -> nn.Module:
    """`nodes`: the machines the ranks span, each a replica under train.fsdp_sharding: hybrid.
    train.compile compiles the wrapped module, in place (pipeline.compiled)."""
    if config.compile:
        # Checked by the stage before it changed anything; again here, on a Slurm node or in a pod.
        check_can_compile(device.type, mode, dp_device_count(device) if mode == "dp" else 1)
        if mode == "ddp" and config.sync_batchnorm and device.type == "cpu":
            raise ConfigError(gloo_batchnorm.NOT_COMPILED)
        # fsdp: each layer it gathers on its own, as torchtitan compiles each block (FSDP2's hooks
        # stop Dynamo from compiling a module that holds them); the others: the whole network.
        compile_forwards(shard_units(model) if mode == "fsdp" else [model], config.deterministic)
    # Autocast inside the module that DataParallel replicates (see pipeline.precision).
    return wrap(with_autocast(model, device, autocast_dtype(device, config.bf16, config.fp16)), mode, device,
                sync_batchnorm=config.sync_batchnorm, replicas=nodes if config.fsdp_sharding == "hybrid" else 1)


def settle_gradient_buckets(wrapped: nn.Module, data: Data) -> None:
    """Let DDP lay out its gradient buckets for good before the first real step.

    DDP reduces the first backward's gradients in parameter order, then lays the bucket out anew
    in the order they became ready (conv weights before their biases here) and keeps that. The
    layout decides which elements each rank sums in a ring all-reduce; with 3 or more ranks, sums
    taken in another order round differently. A run resumed mid-training would reduce its first
    step in the first layout where the uninterrupted run used the second, and end a few ulps off.
    One backward of a zero loss (zero gradients, all-reduced, no optimizer step) makes every run,
    fresh or resumed, train every step in the same layout. The forward runs in training mode, which
    moves batch norm's running statistics: they are put back, as ddp's alone would differ."""
    buffers = [(buffer, buffer.clone()) for buffer in wrapped.buffers()]
    (wrapped(data.sample_input()).float().sum() * 0).backward()
    wrapped.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buffer, kept in buffers:
            buffer.copy_(kept)


def share_loss(outputs: torch.Tensor, targets: torch.Tensor, batch_len: int, world_size: int,
               loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to differentiate, the sum of the per-sample losses) for one rank's share of a
    global batch of `batch_len` samples; `loss`: the workload's, summed over the samples, fed the
    outputs in float32 whatever the autocast.

    The sum is divided by batch_len / world_size, not by the share's own length: DDP averages the
    ranks' gradients, and the average over W of (sum_r / (L/W)) is the whole batch's sum / L, its
    mean loss, however unevenly the batch was shared. With W = 1 (single, and DataParallel, whose
    loss sees the gathered outputs of every GPU) it is the batch's mean. A loss made of per-sample
    terms (MNIST's label smoothing is one) sums to what a single device takes."""
    sample_losses = loss(outputs.float(), targets)
    return sample_losses / (batch_len / world_size), sample_losses.detach()


def micro_batches(share: torch.Tensor, count: int, keep_empty: bool = False) -> list[torch.Tensor]:
    """A rank's share of a global batch in `count` parts for gradient accumulation, their lengths
    within one of each other, the longer first. Parts left empty by a share shorter than `count` (the
    epoch's short last batch) are dropped, but the last part stays, empty or not: DDP all-reduces in
    its backward, and every rank must take part in that. `keep_empty` (fsdp) keeps them all: each
    forward gathers the weights, so every rank must run as many."""
    parts = share.tensor_split(count)
    return list(parts) if keep_empty else [part for part in parts[:-1] if len(part)] + [parts[-1]]


def run_epoch(wrapped: nn.Module, optimizer, scheduler, data: Data, order: torch.Tensor, global_batch: int,
              rank: Rank, probe: Probe, show_bar: bool, desc: str, workload: Workload | None = None,
              max_grad_norm: float = 0.0, grad_accum_steps: int = 1, partial: dict | None = None,
              after_step: Callable | None = None, scaler: torch.amp.GradScaler | None = None,
              device: torch.device | None = None, names: list[str] | None = None, epoch: int = 0):
    """One pass over this rank's shares of the epoch's global batches, under the workload's loss (by
    default MNIST's); returns (loss sum, the workload's metrics summed (add_scores), each step's
    loss summed over this rank's share, the steps whose gradient was clipped) still on the device,
    as a .item() per step would sync every step, and each step's share length (0: this rank had no
    sample that step).

    `grad_accum_steps` > 1 runs each share as that many micro-batches, forward and backward in turn,
    their gradients summed in place before one optimizer step. Each micro-batch's loss is divided by
    the same L/W as the whole share's (share_loss), so the sum is the gradient of the global batch's
    mean loss, as without accumulation, to rounding. DDP all-reduces only in the last micro-batch's
    backward (`no_sync` before it). The step's "forward" phase then holds the earlier micro-batches'
    forward and backward, its "backward" the last one's, where DDP's communication overlaps.

    `max_grad_norm` > 0 clips the gradient to that global norm before each step. DDP's ranks hold
    the same all-reduced gradient by then, so each clips it alike, as one device would.

    `partial`: this rank's part of a mid-epoch checkpoint (its sums over the steps before it), from
    which the epoch goes on at step `partial["step"]`. `after_step(i, loss_sum, scores, clipped,
    losses, shares)` runs after each step i (0-based), to checkpoint.

    `scaler` (train.fp16: precision.grad_scaler) scales each micro-batch's loss before its backward
    and unscales the gradient before clipping; its step skips an optimizer step whose gradient
    overflowed (DDP's ranks hold the same all-reduced gradient, so all skip it alike). The schedule
    steps either way: it counts steps, not updates.

    `device`: where the model is (by default the in-memory data's); `order` is on data.index_device.
    `names`: the workload's metrics (score_names, read once before the epochs; by default here).
    `epoch`: the epoch's number from 0, which seeds its samples' augmentation (Samples.augment)."""
    device = device or data.index_device
    workload = workload or default_workload()
    batches = global_batches(order, global_batch)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    scores = zero_scores(names if names is not None else score_names(workload, unwrap(wrapped), device), device)
    clipped = torch.zeros((), dtype=torch.int64, device=device)
    losses = torch.empty(len(batches), dtype=torch.float32, device=device)
    shares, start = [], 0
    if partial is not None:  # the same sums, to the bit, as the uninterrupted epoch had at this step
        start = partial["step"]
        loss_sum.copy_(partial["loss_sum"])
        kept = partial["scores"] if "scores" in partial else {"accuracy": partial["correct"]}  # MNIST's, from before
        add_scores(scores, {name: value.to(device) for name, value in kept.items()})
        clipped.copy_(partial["clipped"])
        losses[:start] = partial["losses"].to(device)
        shares = list(partial["shares"])
    pause = pause_asked()
    # fsdp: the ranks' BatchNorm statistics kept one, as DDP keeps them; and every micro-batch run, empty
    # ones too, as each forward gathers the weights.
    sync_buffers = sharded(wrapped)
    wrapped.train()
    # Each step's micro-batches of this rank's share, all decided now: a DataLoader reads ahead.
    step_parts = [micro_batches(rank_share(batch, rank), grad_accum_steps, keep_empty=sync_buffers)
                  for batch in batches[start:]]
    feed = data.feed((part for parts in step_parts for part in parts), epoch=epoch)  # epoch: its augmentation
    for i, (batch, part_indices) in enumerate(tqdm(zip(batches[start:], step_parts), desc=desc, disable=not show_bar,
                                                   leave=False, initial=start, total=len(batches)), start):
        probe.start_step(i)
        parts = [next(feed) for _ in part_indices]
        probe.phase("forward")
        step_losses = None  # the share's summed loss
        if sync_buffers:
            broadcast_buffers(wrapped)
        for j, (inputs, targets) in enumerate(parts):
            last = j == len(parts) - 1
            with nullcontext() if last else gradient_sync_held(wrapped):
                outputs = wrapped(inputs)  # in the configured precision: the model enters autocast itself
                loss, sample_losses = share_loss(outputs, targets, len(batch), rank.world_size, workload.loss)
                if j == 0:
                    optimizer.zero_grad(set_to_none=True)
                if last:
                    probe.phase("backward")
                (loss if scaler is None else scaler.scale(loss)).backward()
            step_losses = sample_losses if step_losses is None else step_losses + sample_losses
            add_scores(scores, workload.metrics(outputs.detach().float(), targets))
        probe.phase("optimizer")
        if scaler is not None:
            scaler.unscale_(optimizer)  # the true gradient, for clipping (an overflow leaves inf: not stepped)
        if max_grad_norm:  # torch scales the gradient where norm + 1e-6 > max_grad_norm: counted alike
            norm = clip_gradient(wrapped, max_grad_norm)
            over = norm + 1e-6 > max_grad_norm
            if scaler is not None:  # fp16's overflowed step has an infinite norm: skipped, not clipped
                over &= norm.isfinite()
            clipped += over
        if scaler is None:
            optimizer.step()
            scheduler.step()
        else:
            scaler.step(optimizer)  # reads the overflow flag: one wait for the device a step, fp16's only
            scaler.update()
            with warnings.catch_warnings():  # a skipped first step steps the schedule before the optimizer
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")
                scheduler.step()
        probe.end_step()
        loss_sum += step_losses
        losses[i] = step_losses
        shares.append(sum(len(targets) for _, targets in parts))
        if after_step is not None:
            after_step(i, loss_sum, scores, clipped, losses, shares)
        if pause:
            time.sleep(pause)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the epoch's time must include its queued kernels
    return loss_sum, scores, losses, clipped, shares


def clip_gradient(wrapped: nn.Module, max_grad_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, which takes fsdp's sharded gradients as they are: its norm of
    DTensors sums the shards' squares over the ranks, so every rank scales its shards by the whole
    gradient's norm (tests/test_fsdp.py), returned here as a plain tensor, the same on every rank."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_grad_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


LOSS_WINDOWS_PER_EPOCH = 20
TRACE_DIR = "traces"  # in models/<mode>: each rank's profiler trace of a few steps


def loss_windows(step_sums: list[float], batch_lens: list[int], first_step: int) -> list[list[float]]:
    """[last step, mean training loss] of each run of steps, about LOSS_WINDOWS_PER_EPOCH an epoch:
    a curve with a shape even when training lasts one epoch, smoother than the steps' own losses."""
    size = max(1, math.ceil(len(step_sums) / LOSS_WINDOWS_PER_EPOCH))
    return [[first_step + start + len(step_sums[start:start + size]) - 1,
             sum(step_sums[start:start + size]) / sum(batch_lens[start:start + size])]
            for start in range(0, len(step_sums), size)]


def check_finite(mode: str, epoch: int, loss_sum: torch.Tensor, losses: list[float], first_step: int,
                 rank: Rank) -> None:
    """A NaN or infinite loss means training diverged: stop with the step, not train on garbage.
    `loss_sum` is summed over the ranks, so every rank stops at the same epoch."""
    if math.isfinite(loss_sum.item()):
        return
    bad = next((first_step + i for i, value in enumerate(losses) if not math.isfinite(value)), None)
    where = f"step {bad}" if bad else "a step of another rank"
    raise PipelineError(
        f"{mode}: the training loss is not finite at epoch {epoch}, {where}"
        f"{f' (rank {rank.rank})' if rank.world_size > 1 else ''}: training diverged. Lower train.lr, "
        "then train again from scratch (the checkpoint holds the last finite epoch)")


def train(run: Training, train_split: Data, val_split: Data) -> tuple[nn.Module, list[dict]]:
    """Train, checkpoint every epoch (and every train.checkpoint_every_steps steps); return the
    trained (unwrapped) model and per-epoch metrics. The splits: DeviceSplits on run.device, or
    batches.Loaded that move each batch there."""
    config, rank, device = run.config, run.rank, run.device
    check_world_size(config.batch_size, rank.world_size, config.grad_accum_steps)
    steps = steps_per_epoch(len(train_split), config.batch_size)
    workload = load_workload(run.workload)
    model, optimizer, scheduler = build(config, config.epochs * steps, device, workload)
    names = score_names(workload, model, device)  # before any epoch seeds its draws
    scaler = grad_scaler(device, config.fp16)
    checkpoint_path = run.out_dir / CHECKPOINT_FILE
    # A sharded checkpoint's parts are read once the model is wrapped as it was when they were written.
    resume_shards = run.resume_state is not None and shards.TAG_KEY in run.resume_state
    if config.checkpoint_format in shards.SHARDED or resume_shards:  # before any step: every rank reads
        shards.check_shared(run.out_dir, rank,  # and writes in the folder
                            f"train.checkpoint_format: {config.checkpoint_format}" if config.checkpoint_format
                            in shards.SHARDED else f"resuming {run.out_dir / CHECKPOINT_FILE}, a sharded checkpoint,")
    writer = shards.Writer(run.out_dir, rank, config.checkpoint_format)

    start_epoch, history, partial = 0, [], None
    if run.resume_state is not None:  # the same state on every rank: rank 0 read and sent it
        state = run.resume_state
        # The stage refused this before changing anything (train's pick_up); a worker's own disk may
        # still hold a checkpoint of another length.
        check_schedule_length(state, config.epochs * steps, run.out_dir / CHECKPOINT_FILE)
        if not resume_shards:
            model.load_state_dict(state["model"])  # fsdp's too: whole weights, sharded as they are wrapped
        if run.mode != "fsdp":
            if not resume_shards:
                optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None:  # fp16 is a trajectory key: its checkpoints hold the scale
            scaler.load_state_dict(state["scaler"])
        start_epoch, history = state["epoch"], state["history"]
        partial = in_epoch_part(state, rank, run.out_dir / CHECKPOINT_FILE)
    if run.mode == "fsdp" and run.resume_state is not None \
            and run.resume_state.get("replicas", 1) != replicas(run):
        raise PipelineError(
            f"fsdp: {run.out_dir / CHECKPOINT_FILE} was trained with {run.resume_state.get('replicas', 1)} replica(s) of "
            f"the model (train.fsdp_sharding: hybrid, one a node), and this training has {replicas(run)}: its "
            "gradients would be summed in another order, and the resume would not end where the training would "
            f"have; resume on as many nodes of {rank.local_world_size} workers, or train afresh without --resume")
    wrapped = wrap_for_mode(model, config, device, run.mode, nodes(rank))
    if run.mode == "fsdp":  # sharding made new parameters: the optimizer steps those, each rank its shards
        optimizer = build_optimizer(wrapped.parameters(), config)
        scheduler = build_schedule(optimizer, config, config.epochs * steps)
        if run.resume_state is not None:
            if not resume_shards:
                load_sharded_optimizer(model, optimizer, run.resume_state["optimizer"])
            scheduler.load_state_dict(run.resume_state["scheduler"])
    if resume_shards:
        shards.load(run.out_dir, run.resume_state, model, optimizer)
    # The step's phases (on every step on the CPU); its communication, and a trace, on a window of
    # the last epoch.
    probe = Probe(device, window=config.breakdown_steps, trace_steps=config.trace_steps,
                  trace_dir=run.out_dir / TRACE_DIR, warmup=config.throughput_warmup_steps,
                  repeats=config.breakdown_repeats)
    probe.attach(wrapped, rank.world_size)
    if run.mode == "ddp":
        settle_gradient_buckets(wrapped, train_split)

    # Validation is dealt out as the training batches are: every W-th image from rank r's position.
    val_indices = torch.arange(rank.rank, len(val_split), rank.world_size)
    # fsdp gathers the weights in each forward, so every rank runs as many: as many as the longest share needs.
    val_batches = math.ceil(math.ceil(len(val_split) / rank.world_size) / config.eval_batch_size) \
        if run.mode == "fsdp" else None
    # The devices whose peak memory is reported: DataParallel's GPUs, or this rank's device.
    memory_devices = list(range(dp_device_count(device))) if run.mode == "dp" else [device.index]
    show_bar = rank.is_main and sys.stderr.isatty()
    # With step checkpoints on, a preemption notice (SIGTERM, SIGUSR1) stops the training after a
    # step, checkpointed (pipeline.preemption).
    notice = Notice(rank) if config.checkpoint_every_steps else None
    with notice or nullcontext():
        for epoch in range(start_epoch, config.epochs):
            seed_dropout(config.seed, epoch, rank.rank, memory_devices if run.mode == "dp" else [])
            # Devices whose random draws (dropout) a mid-epoch checkpoint keeps, the CPU's beside them.
            rng_devices = memory_devices if device.type == "cuda" else []
            resumed, partial = partial, None  # a mid-epoch checkpoint's part: this epoch goes on from it
            if resumed is not None:
                set_rng_states(resumed["rng"], rng_devices)
            carried_s = resumed["wall_s"] if resumed else 0.0  # this rank's time in the epoch before the resume
            order = epoch_order(len(train_split), epoch, config.seed).to(train_split.index_device)
            if device.type == "cuda":
                for index in memory_devices:
                    torch.cuda.reset_peak_memory_stats(index)
                torch.cuda.synchronize(device)
            # What else the host (and this rank's GPUs) ran meanwhile.
            host = hostload.Sample(hostload.gpu_uuids(memory_devices) if device.type == "cuda" else None)
            started = time.perf_counter()
            first_step = epoch * steps + 1
            # A resumed epoch's steps before the resume ran in another process: its breakdown is not measured.
            probe.start_epoch(steps, measure=epoch == config.epochs - 1 and resumed is None)

            loss_sum, scores, losses, clipped, shares = run_epoch(
                wrapped, optimizer, scheduler, train_split, order, config.batch_size, rank,
                probe=probe, show_bar=show_bar, desc=f"{run.mode} epoch {epoch + 1}/{config.epochs}",
                workload=workload, names=names, max_grad_norm=config.max_grad_norm,
                grad_accum_steps=config.grad_accum_steps, partial=resumed, scaler=scaler, device=device,
                epoch=epoch,
                after_step=step_checkpoints(run, model, wrapped, optimizer, scheduler, scaler, history, epoch, steps,
                                            lambda: rng_states(rng_devices), started - carried_s, notice, writer))
            train_wall = time.perf_counter() - started + carried_s
            host_record = host.finish()

            rank_samples = sum(shares)
            rank_loss = loss_sum.item() / max(1, rank_samples)
            # Steady state: the steps after the warm-up (cuDNN/cuBLAS handles, algorithm choice, lazy
            # kernel loading, DDP's bucket rebuild), which on a fast GPU dominate a short epoch.
            steady_wall = probe.steady_seconds()
            # The profiler's own start, stop and export ran in the steady steps, unless before them.
            steady_traced = probe.traced and probe.trace_start >= config.throughput_warmup_steps
            steady_samples = sum(shares[config.throughput_warmup_steps:probe.steady_end])
            # Each step's loss sum rides along in the epoch's one all_reduce: the loss curve of the
            # global batches (loss_windows), the same in every mode.
            names = list(scores)  # the workload's metrics, in the same order on every rank (score_names)
            sums = all_sum(torch.cat([torch.stack([loss_sum, loss_sum.new_tensor(rank_samples),
                                                   loss_sum.new_tensor(steady_samples)]),
                                      stacked(scores, names, device), losses.double()]), rank)
            train_sums, train_scores, step_sums = sums[:3], sums[3:3 + len(names)], sums[3 + len(names):].tolist()
            losses = losses.tolist()  # one copy per epoch
            check_finite(run.mode, epoch + 1, train_sums[0], losses, first_step, rank)
            with eager(config.compile):  # train.compile's graphs are for training (pipeline.compiled)
                val = evaluate(unwrap(wrapped), val_split, val_indices, config.eval_batch_size, device, workload,
                               names, val_batches)
            val_sums = dict(zip(val, all_sum(stacked(val, list(val), device), rank)))  # [loss, *names, count], as before
            epoch_time = time.perf_counter() - started + carried_s
            breakdown = probe.results()  # before the clock's totals, which clear its marks
            if breakdown is not None and probe.trace_file is not None:
                breakdown["timeline"] = timeline(probe.trace_file, rank.rank)
            # One exchange per epoch: every rank's times, its step breakdown, and its weights' checksum
            # to prove they agree.
            walls, overheads, steady_walls, epoch_times, checksums, breakdowns, hosts, states, peaks = zip(
                *all_gather_objects((train_wall, probe.overhead_s, steady_wall, epoch_time, weight_checksum(model),
                                     breakdown, host_record, state_mb(wrapped, optimizer),
                                     peak_memory_mb(device) if device.type == "cuda" else None), rank))
            if len(set(checksums)) > 1:
                raise RuntimeError(f"ranks out of sync after epoch {epoch + 1}: weight checksums per rank {checksums}")
            waited = probe.traced and probe.trace_start + probe.traced < steps
            train_times, steady_times = without_profiler(walls, overheads, steady_walls, steady_traced, waited)
            train_time = train_times[rank.rank]
            slowest = max(train_times)  # the slowest rank sets the pace of a synchronous step
            metrics = {
                "epoch": epoch + 1,
                "train_loss": (train_sums[0] / train_sums[1]).item(),
                # The workload's metrics, each a sum over the samples divided by their count.
                **{f"train_{name}": (value / train_sums[1]).item() for name, value in zip(names, train_scores)},
                "val_loss": (val_sums["loss"] / val_sums["count"]).item(),
                **{f"val_{name}": (val_sums[name] / val_sums["count"]).item() for name in names},
                "scores": names,
                "samples_per_s": train_sums[1].item() / slowest,
                "train_time_s": slowest,
                # None when the epoch has no step after the warm-up.
                "steady_samples_per_s": (train_sums[2].item() / max(steady_times)
                                         if None not in steady_times and max(steady_times) > 0 else None),
                "steady_time_s": max(steady_times) if None not in steady_times else None,
                "epoch_time_s": max(epoch_times),
                "steady_steps": max(0, probe.steady_end - config.throughput_warmup_steps),
                # Cores other processes kept busy on the busiest host meanwhile (pipeline.hostload).
                "host_load": hostload.others(list(hosts), max(walls)),
                # The schedule's rate at the epoch's end (train.schedule; the one-cycle's peak is train.lr).
                "lr_at_epoch_end": scheduler.get_last_lr()[0],
                # Steps whose gradient was clipped (train.max_grad_norm), the same on every rank.
                "clipped_steps": clipped.item(),
                "loss_windows": loss_windows(step_sums, [len(b) for b in global_batches(order, config.batch_size)],
                                             first_step),
                "rank_weight_checksums": list(checksums),
                # Each rank's parameters, gradients and optimizer state, in MiB (state_mb).
                "rank_state_mb": list(states),
            }
            if device.type == "cuda":  # each rank's allocator peak this epoch, activations and workspaces too
                metrics["rank_peak_memory_mb"] = list(peaks)
            if scaler is not None:  # fp16's loss scale at the epoch's end: halved by each overflow
                metrics["loss_scale"] = scaler.get_scale()
            if breakdown is not None:  # every rank's, on every rank
                metrics["breakdown"] = list(breakdowns)
            if resumed is not None:  # its times add the steps before the resume (each rank's own) to those after
                metrics["resumed_at_step"] = resumed["step"]
            if run.mode == "dp" and device.type == "cuda":  # DataParallel's memory, GPU by GPU
                metrics.update({f"gpu{i}_peak_memory_mb": torch.cuda.max_memory_allocated(i) / 2**20
                                for i in memory_devices})
            rank_metrics = {
                "loss": rank_loss,
                "samples_per_s": rank_samples / train_time,
                **probe.clock.totals(),
                **({f"step_{key}_s": value for key, value in breakdown["median_s"].items() if value is not None}
                   if breakdown else {}),
                "peak_memory_mb": peak_memory_mb(device),
                "state_mb": states[rank.rank],
                "weight_checksum": checksums[rank.rank],
                # A step in which this rank had no sample has no loss of its own to show.
                "step_losses": [(first_step + i, value / shares[i]) for i, value in enumerate(losses)
                                if run.log_every_n_steps and (first_step + i) % run.log_every_n_steps == 0
                                and shares[i]],
            }
            history.append(metrics)
            if sharded(wrapped):  # evaluation's forwards leave the root's own parameters gathered
                wrapped.reshard()
            # The last is whole whatever the format: model.pt gathers the weights now anyway.
            state = checkpoint_state(model, wrapped, optimizer, scheduler, scaler, epoch + 1, history, config, run,
                                     writer, shard_tag=shards.tag(epoch + 1, 0) if epoch + 1 < config.epochs else None)
            if rank.is_main:
                report_epoch(run.mode, config.epochs, metrics)
                writer.commit(checkpoint_path, state)
            for hook in run.epoch_hooks:
                hook(metrics, rank_metrics)
            crash_if_asked(epoch + 1, settle=writer.wait)
    writer.wait()
    if config.compile:
        uncompile(model)
        said = f"{run.mode}: torch.compile (train.compile): {graphs_compiled()} graph(s) compiled on rank {rank.rank}"
        if not graphs_compiled():  # trained, but eager: said, not hidden (TORCH_LOGS=graph_breaks says why)
            log.warning("%s: the model ran eager; TORCH_LOGS=graph_breaks shows why", said)
        elif rank.is_main:
            log.info("%s", said)
    if run.mode == "fsdp":  # what the stage saves and logs (rank 0): the whole model, on the CPU
        weights = full_state_dict(model)
        if rank.is_main:
            whole = workload.build_model()
            whole.load_state_dict(weights)
            return whole, history
    return model, history


def step_checkpoints(run: Training, model: nn.Module, wrapped: nn.Module, optimizer, scheduler, scaler,
                     history: list[dict], epoch: int, steps: int, rng: Callable[[], dict], started: float,
                     notice: Notice | None, writer: shards.Writer) -> Callable | None:
    """run_epoch's `after_step` under train.checkpoint_every_steps (None when 0): every N global steps
    but an epoch's last (its own checkpoint follows), and after the step every rank agreed to stop at
    on a preemption notice, every rank's part of the epoch so far goes into the checkpoint rank 0
    writes. `started`: when this rank's epoch started, the time before a resume included."""
    every, rank = run.config.checkpoint_every_steps, run.rank
    if notice is None:
        return None

    def after_step(i: int, *sums) -> None:
        done = epoch * steps + i + 1
        stop = notice.agreed()
        if not stop and (done % every or i + 1 == steps):
            return
        parts = all_gather_objects(in_epoch_sums(i + 1, *sums, rng=rng(), wall_s=time.perf_counter() - started), rank)
        state = checkpoint_state(model, wrapped, optimizer, scheduler, scaler, epoch, history, run.config, run,
                                 writer, shard_tag=shards.tag(epoch, i + 1))
        if rank.is_main:
            writer.commit(run.out_dir / CHECKPOINT_FILE,
                          {**state, "in_epoch": {"world_size": rank.world_size, "ranks": parts}})
        broadcast_object(None, rank)  # no rank steps on (or is stopped) before the file is whole (or, async, committed)
        if stop:  # ends as the signal would have ended it, but a step later, with nothing lost
            writer.wait()
            if rank.is_main:
                said = (f"{run.mode}: {signal.Signals(stop).name}, so training stopped after step {done} (epoch "
                        f"{epoch + 1}, step {i + 1} of {steps}), checkpointed in {run.out_dir / CHECKPOINT_FILE}")
                log.warning("%s; a resume goes on from the next step", said)
                say_stopped(said)
            raise SystemExit(128 + stop)
        crash_if_asked(done, "STEP", settle=writer.wait)

    return after_step


def checkpoint_state(model: nn.Module, wrapped: nn.Module, optimizer, scheduler, scaler, epochs_done: int,
                     history: list[dict], config: TrainConfig, run: Training, writer: shards.Writer,
                     shard_tag: str | None) -> dict[str, Any]:
    """What a checkpoint holds, made on every rank (a collective: fsdp's gathers its shards) and
    written by rank 0: the whole model and optimizer state, whatever the mode; or, in a sharded
    train.checkpoint_format with a `shard_tag`, each rank's part, which `writer` writes from every
    rank (pipeline.shards), and, in the file, the tag that names them."""
    if writer.sharded and shard_tag is not None:
        weights = writer.parts(shard_tag, model, optimizer)
    else:
        writer.wait()  # a whole one after sharded ones (the last): their write ends first
        weights = {"model": full_state_dict(model),
                   "optimizer": optimizer.state_dict() if not sharded(wrapped) else whole_optimizer_state(model, optimizer)}
    return {
        # fsdp: how many replicas (nodes, under hybrid sharding) summed each gradient: a resume in
        # another layout would sum them in another order.
        **({"replicas": replicas(run)} if sharded(wrapped) else {}),
        **weights,
        "scheduler": scheduler.state_dict(),
        **({"scaler": scaler.state_dict()} if scaler is not None else {}),
        "epoch": epochs_done,
        "history": history,
        "trajectory": trajectory(config, run.mode, run.workload),
        "extra": run.extra_state,
    }


def replicas(run: Training) -> int:
    """fsdp's replicas of the model: the nodes under train.fsdp_sharding: hybrid, else 1."""
    return nodes(run.rank) if run.config.fsdp_sharding == "hybrid" else 1


def whole_optimizer_state(model: nn.Module, optimizer) -> dict[str, Any]:
    """fsdp's optimizer state gathered whole, keyed by the names of `model`'s parameters (the bare
    network's, as the checkpoint's weights: the same whatever the precision wraps it in), on the
    CPU of rank 0 (the others get {}: no rank holds it all on its device)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_sharded_optimizer(model: nn.Module, optimizer, whole: dict[str, Any]) -> None:
    """whole_optimizer_state's inverse: each rank keeps its shards of the saved state (which every
    rank was sent), on its device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, whole, options=StateDictOptions(full_state_dict=True))


def in_epoch_sums(step: int, loss_sum: torch.Tensor, scores: dict[str, torch.Tensor], clipped: torch.Tensor,
                  losses: torch.Tensor, shares: list[int], rng: dict, wall_s: float) -> dict[str, Any]:
    """One rank's part of a mid-epoch checkpoint: its sums over the epoch's first `step` steps, its
    random generators' states and its time so far, on the CPU."""
    return {"step": step, "loss_sum": loss_sum.cpu(), "scores": {name: value.cpu() for name, value in scores.items()},
            "clipped": clipped.cpu(),
            "losses": losses[:step].cpu(), "shares": list(shares), "rng": rng, "wall_s": wall_s}


def in_epoch_part(state: dict[str, Any], rank: Rank, path: Path) -> dict[str, Any] | None:
    """This rank's part of a mid-epoch checkpoint, or None for one written at an epoch's end. Each
    rank carries its own sums and random state, so the world size must be the one that wrote it
    (train's pick_up said so before the launch; a worker checks again)."""
    refused = other_world(state, rank.world_size, path)
    if refused:
        raise PipelineError(refused)
    return state["in_epoch"]["ranks"][rank.rank] if state.get("in_epoch") else None


def rng_states(cuda_devices: list[int]) -> dict[str, Any]:
    return {"cpu": torch.get_rng_state(), "cuda": [torch.cuda.get_rng_state(i) for i in cuda_devices]}


def set_rng_states(states: dict[str, Any], cuda_devices: list[int]) -> None:
    torch.set_rng_state(states["cpu"])
    for index, saved in zip(cuda_devices, states["cuda"]):
        torch.cuda.set_rng_state(saved, index)


def seed_dropout(seed: int, epoch: int, rank: int, dp_gpus: list[int]) -> None:
    """Seeds each epoch's random draws (dropout) per epoch, so that a resumed training draws what
    it would have drawn, and per rank, so that DDP's ranks drop different units of their different
    samples. DataParallel's replicas draw from their own GPU's generator, which torch.manual_seed
    seeds alike on every GPU: each of `dp_gpus` gets a stream of its own too. (The initial weights
    come from `build`'s seed, the same everywhere.)"""
    base = seed + 10_000 * (epoch + 1) + rank
    torch.manual_seed(base)
    for index in dp_gpus[1:]:  # GPU 0 keeps the base seed, as a single-GPU training's
        torch.cuda.default_generators[index].manual_seed(base + 1_000_003 * index)


def without_profiler(walls: tuple[float, ...], overheads: tuple[float, ...], steady_walls: tuple[float | None, ...],
                     steady_traced: bool, waited: bool) -> tuple[list[float], list[float | None]]:
    """Every rank's training time, and steady time, without the profiler's own work (its start,
    stop and export). `waited`: a later step of the epoch all-reduced after it, and a rank whose
    work was quicker waited there for the slowest, so its wall time holds the largest overhead of
    any rank, not its own: that one comes off every rank's time (each rank's own left the slowest
    rank's overhead, less the quickest's, in max(train_time)). `steady_traced`: the profiler ran
    within the steady steps."""
    own = [max(overheads) if waited else overhead for overhead in overheads]
    return ([wall - off for wall, off in zip(walls, own)],
            [None if wall is None else wall - (off if steady_traced else 0.0) for wall, off in zip(steady_walls, own)])


def crash_if_asked(count: int, unit: str = "EPOCH", settle: Callable[[], None] | None = None) -> None:
    """Test hook: MNIST_PIPELINE_CRASH_AFTER_EPOCH=N (or _STEP=N, a global step) kills a first
    attempt right after that epoch's (step's) checkpoint, as a lost node would, so resume can be
    tested against an uninterrupted run. `settle`: waits for the checkpoint's write (async)."""
    name = f"MNIST_PIPELINE_CRASH_AFTER_{unit}"
    if os.environ.get(name) == str(count) and not restarted():
        if settle is not None:
            settle()
        print(f"crashing after {unit.lower()} {count} ({name})", file=sys.stderr, flush=True)
        os._exit(75)


def pause_asked() -> float:
    """Test hook: MNIST_PIPELINE_STEP_PAUSE_S=S, seconds run_epoch sleeps after each step, so a test
    that acts on a training while it runs (an edit, a stop) has one that lasts, idle, instead of
    many epochs that take the CPU the suite's other tests need (docs/testing.md, #52)."""
    return float(os.environ.get("MNIST_PIPELINE_STEP_PAUSE_S") or 0)


def report_epoch(mode: str, epochs: int, m: dict) -> None:
    def scored(split: str) -> str:  # its loss, then the workload's metrics (MNIST: "acc")
        return " ".join([f"{split} loss {m[f'{split}_loss']:.4f}"]
                        + [f"{SHORT.get(name, name)} {m[f'{split}_{name}']:.4f}" for name in m["scores"]])

    log.info(f"{mode} epoch {m['epoch']}/{epochs}: {scored('train')} | {scored('val')} | "
             f"{m['samples_per_s']:.0f} samples/s, training {m['train_time_s']:.1f} s + validation "
             f"{m['epoch_time_s'] - m['train_time_s']:.1f} s")


SHORT = {"accuracy": "acc"}  # the log line's names for common metrics
