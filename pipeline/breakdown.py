"""Where a training step's time goes, measured on the steps themselves.

Three instruments, all on every rank:
- `StepClock` stamps each step at the edges of its phases (data, forward, backward, optimizer):
  perf_counter on the CPU, where work is synchronous, on every step; CUDA events on a GPU, read once
  an epoch so nothing syncs per step, and recorded only on the steps that need them (the measured
  window, the first steady step and the epoch's last), so the other steps launch nothing extra.
- `CommTimer` is DDP's gradient all-reduce as a communication hook, the same arithmetic as DDP's
  built-in one (each bucket scaled by 1/W, then summed), which stamps when each bucket is handed to
  the backend (its gradients are ready) and when its all-reduce completes, on the same clock. It is
  registered when the measured window opens (DDP's reducer reads its hook afresh each backward), so
  the steps before run DDP's built-in all-reduce, with no Python on the gradients' path.
- `ShardTimer` is FSDP2's all-gather and reduce-scatter, FSDP's own default collectives (the same
  calls, the same bits) set on every unit with `set_custom_all_gather`/`set_custom_reduce_scatter`,
  which stamp each call's start and end on the same clock while a measured step runs. On the CPU
  FSDP2 makes each call synchronously on the training thread (torch 2.14: `foreach_reduce` passes
  no `async_op`, and `unshard`'s is False, there being no stream to prefetch on), so every second of
  it is one the step waited: exposed, inside the phase it fell in. On a GPU the collectives run on
  streams of their own beside the compute, and under hybrid sharding an all-reduce between the
  replicas follows the reduce-scatters: neither is timed, and the breakdown says its communication
  is unmeasured (None), never 0.
- `Tracer` runs torch.profiler over a few steps after the measured window and keeps its Chrome
  trace (Perfetto opens it): the phases as record_function ranges, the backend's own collective
  events (gloo:all_reduce on its threads, NCCL's kernels on their stream) and DataParallel's
  scatter, replicate, replicas and gather.

How overlap is measured (HTA's definitions, on our own stamps): a step's communication time is the
union of its buckets' [handed over, completed] intervals. The backward's compute ends when the last
bucket is handed over (the last gradient is then ready, so autograd has nothing left to compute).
Communication inside [backward start, that moment] ran during compute: it is overlapped. The rest
is exposed: the step waited for it. The backward's compute is the backward less its exposed part,
so data + forward + backward compute + exposed communication + optimizer = the step.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.parallel import sharded

log = logging.getLogger(__name__)
PHASES = ("data", "forward", "backward", "optimizer")
# The backend's collective events in a torch.profiler trace: gloo's on its worker threads, NCCL's
# CPU-side calls and its kernels on the GPU.
COMM_EVENT_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")
DP_PARTS = ("scatter", "replicate", "replicas", "gather")  # DataParallel's forward, in order


class StepClock:
    """Stamps at the start of each stamped step and at the end of each of its phases: 5 a step."""

    PER_STEP = len(PHASES) + 1
    PHASES = tuple(f"{phase}_time_s" for phase in PHASES)  # the per-epoch totals' names

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[int, list] = {}  # this epoch's stamped steps: step -> its stamps
        self.step: int | None = None  # the step being stamped; None: this step is not

    def stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    def start_step(self, step: int, stamped: bool) -> None:
        self.step = step if stamped else None
        self.mark()

    def mark(self) -> None:
        if self.step is not None:
            self.marks.setdefault(self.step, []).append(self.stamp())

    def step_marks(self, step: int) -> list:
        return self.marks.get(step, [])

    def seconds_since_step(self, step: int) -> float | None:
        """Seconds from the start of step `step` (0-based) of this epoch to the end of its last
        stamped step; None when `step` was not stamped (the epoch has no such step). Call before
        `totals`, which clears the marks."""
        if step not in self.marks:
            return None
        last = self.marks[max(self.marks)]
        return self.seconds(self.marks[step][0], last[-1]) if len(last) == self.PER_STEP else None

    def seconds_between(self, step: int, end: int) -> float | None:
        """Seconds from the start of step `step` to the start of step `end`; None unless both were stamped."""
        if step not in self.marks or end not in self.marks:
            return None
        return self.seconds(self.marks[step][0], self.marks[end][0])

    def totals(self) -> dict[str, float]:
        """The epoch's seconds per phase, at full precision: a phase of microseconds a step (an
        optimizer step on a fast GPU) must not round to zero; round only where a person reads it.
        Only where every step was stamped (the CPU): a GPU's stamped steps are a sample, whose
        medians are the breakdown's (step_<phase>_s)."""
        marks, self.marks = self.marks, {}
        if self.cuda:
            return {}
        sums = [0.0] * len(PHASES)
        for stamps in marks.values():
            for phase, (start, end) in enumerate(zip(stamps, stamps[1:])):
                sums[phase] += self.seconds(start, end)
        return dict(zip(self.PHASES, sums))


class CommTimer:
    """DDP's gradient all-reduce as a comm hook, stamping each bucket while `step` is not None."""

    def __init__(self, clock: StepClock, ddp: nn.parallel.DistributedDataParallel, world_size: int):
        self.clock, self.ddp, self.world_size = clock, ddp, world_size
        self.step: int | None = None
        self.calls: list[list] = []  # [step, bucket index, bytes, handed over, completed]
        self.attached = False

    def hook(self, _state, bucket):  # unannotated: DDP checks annotations, which are strings here
        buffer = bucket.buffer()
        handed = self.clock.stamp() if self.step is not None else None
        # What DDP's built-in reduction does: gradients times 1/W (a float32 multiply, as its
        # mul_out by a wrapped scalar), then a sum over the ranks: the same bits as without a hook.
        buffer.mul_(1.0 / self.world_size)
        future = dist.all_reduce(buffer, async_op=True).get_future()
        if handed is None:
            return future.then(lambda done: done.value()[0])
        call = [self.step, bucket.index(), buffer.numel() * buffer.element_size(), handed, None]
        self.calls.append(call)

        def completed(done):
            # On a GPU this runs on a stream that waits for the all-reduce: the event marks its end.
            call[4] = self.clock.stamp()
            return done.value()[0]

        return future.then(completed)

    def attach(self) -> None:
        """Between two steps, on every rank alike. DDP registers a hook once and for good; its
        reducer reads it afresh on each backward, and copies gradients into the buckets unscaled
        once there is one, which the hook then scales: the same bits as before. (torch's docs ask for
        the hook before the first backward; torch 2.14's reducer (reducer.cpp, mark_variable_ready_dense
        and run_comm_hook) checks comm_hook_ each time and enforces only "once". The 3-rank test in
        tests/test_breakdown.py holds the weights bit for bit on gloo; NCCL's path never ran here.)"""
        self.ddp.register_comm_hook(None, self.hook)
        self.attached = True


def shard_timer(clock: StepClock, model: nn.Module) -> ShardTimer:
    """FSDP2's collectives on every unit of `model` (the root included), timed by one ShardTimer."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    timer = ShardTimer(clock)

    class TimedAllGather(DefaultAllGather):  # FSDP's default, so its checks of the kind still pass
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return timer.timed("all_gather", output_tensor, lambda: super(TimedAllGather, self).__call__(
                output_tensor, input_tensor, group, async_op))

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return timer.timed("reduce_scatter", input_tensor, lambda: super(TimedReduceScatter, self).__call__(
                output_tensor, input_tensor, group, op, async_op))

    gather, scatter = TimedAllGather(), TimedReduceScatter()
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(scatter)
    return timer


class ShardTimer:
    """Each of FSDP2's collectives while `step` is not None: [step, kind, bytes, start, end], the
    bytes those of the whole (gathered, or to be scattered) buffer."""

    KINDS = ("all_gather", "reduce_scatter")

    def __init__(self, clock: StepClock):
        self.clock = clock
        self.step: int | None = None
        self.calls: list[list] = []

    def timed(self, kind: str, whole: torch.Tensor, call):
        if self.step is None:
            return call()
        start = self.clock.stamp()
        work = call()
        self.calls.append([self.step, kind, whole.numel() * whole.element_size(), start, self.clock.stamp()])
        return work

    def per_step(self, steps: list[int]) -> dict[str, dict]:
        """Each kind's calls, bytes and seconds a step: the medians over `steps`."""
        out = {}
        for kind in self.KINDS:
            rows = [[c for c in self.calls if c[0] == step and c[1] == kind] for step in steps]
            out[kind] = {"calls": statistics.median(len(r) for r in rows),
                         "bytes": statistics.median(sum(c[2] for c in r) for r in rows),
                         "median_s": statistics.median(sum(self.clock.seconds(c[3], c[4]) for c in r) for r in rows)}
        return out


def timed_data_parallel(dp: nn.DataParallel, clock: StepClock, parts: dict[str, list]) -> None:
    """Stamp DataParallel's forward part by part (on its GPUs): scatter the batch from GPU 0,
    replicate the module to every GPU, run the replicas in threads, gather the outputs on GPU 0.
    Its gradient reduce onto GPU 0 runs inside autograd, in the backward (the trace shows it)."""
    for part, method in zip(DP_PARTS, ("scatter", "replicate", "parallel_apply", "gather")):
        original = getattr(dp, method)

        def timed(*args, _original=original, _part=part, **kwargs):
            # A range for the trace (nothing without a profiler running); stamps on measured steps.
            with torch.profiler.record_function(f"dp:{_part}"):
                if not parts.get("recording"):
                    return _original(*args, **kwargs)
                start = clock.stamp()
                result = _original(*args, **kwargs)
                parts[_part].append((start, clock.stamp()))
            return result

        setattr(dp, method, timed)  # an instance attribute: DataParallel.forward calls self.<method>
    for part in DP_PARTS:
        parts[part] = []


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def overlap_with(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    clipped = [(max(a, window[0]), min(b, window[1])) for a, b in intervals]
    return union_length([(a, b) for a, b in clipped if b > a])


def step_breakdown(phases: list[float], comm: list[tuple[float, float]], blocking: bool = False) -> dict[str, float]:
    """One step, in seconds: `phases` the durations of PHASES, `comm` each bucket's [handed over,
    completed] offsets from the step's start; with `blocking`, each collective's [start, end] on the
    thread that waited for it (FSDP2's on the CPU): all exposed, in the phase it fell in."""
    data, forward, backward, optimizer = phases
    out = dict(zip(PHASES, phases), step=sum(phases), forward_compute=forward)
    backward_start = data + forward
    if blocking:
        total = union_length(comm)
        out.update(comm=total, comm_overlapped=0.0, comm_exposed=total,
                   forward_compute=forward - overlap_with(comm, (data, backward_start)),
                   backward_compute=backward - overlap_with(comm, (backward_start, backward_start + backward)),
                   compute=sum(phases) - total)
        return out
    compute_end = max((handed for handed, _ in comm), default=backward_start + backward)
    total = union_length(comm)
    overlapped = overlap_with(comm, (backward_start, compute_end))
    exposed = total - overlapped
    out.update(comm=total, comm_overlapped=overlapped, comm_exposed=exposed, backward_compute=backward - exposed,
               compute=sum(phases) - exposed)
    return out


class Probe:
    """What the loop calls around each step: the clock on the steps it needs; for the measured
    window, the comm timer and DataParallel's parts; for the traced steps after it, the profiler."""

    def __init__(self, device: torch.device, window: int = 0, trace_steps: int = 0, trace_dir: Path | None = None,
                 warmup: int = 0, repeats: int = 1):
        self.clock = StepClock(device)
        self.window, self.trace_steps, self.trace_dir, self.warmup = window, trace_steps, trace_dir, warmup
        self.repeats = repeats
        self.comm: CommTimer | None = None
        self.shard: ShardTimer | None = None  # fsdp's collectives, on the CPU
        self.comm_unmeasured: str | None = None  # why a mode that communicates has no comm measured
        self.dp_parts: dict[str, list] = {}
        self.measure = False  # this epoch's window is measured (the last epoch's)
        self.first = self.traced = self.steps = self.measured = self.trace_start = 0
        self.window_steps: list[int] = []  # this epoch's measured steps, in order
        # DDP's comm hook, once attached, runs (in Python) on every later step: it waits for the last
        # window, so the other windows and the steady throughput before it time DDP as it runs unwatched.
        self.hook_from = 0
        self.steady_end = 0  # the steady throughput's steps end here (the epoch's end, or the hook)
        self.in_windows: set[int] = set()
        self.windows = 0
        self.step = 0
        self.open_range = None
        self.profiler = None
        self.trace_file: Path | None = None
        # Seconds the profiler itself took (its start, stop and trace export) this epoch: left out
        # of the epoch's training time, which the traced steps themselves stay in.
        self.overhead_s = 0.0

    def attach(self, wrapped: nn.Module, rank_world: int) -> None:
        if not self.window:
            return
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            self.comm = CommTimer(self.clock, wrapped, rank_world)  # hooked when the window opens
        elif isinstance(wrapped, nn.DataParallel):
            timed_data_parallel(wrapped, self.clock, self.dp_parts)
        elif sharded(wrapped) and rank_world > 1:
            if self.clock.cuda:
                self.comm_unmeasured = ("fsdp on a GPU: FSDP2's collectives run on streams of their own, and what "
                                        "of them the compute waits for is not measured")
            elif next(wrapped.parameters()).device_mesh.ndim > 1:
                self.comm_unmeasured = ("fsdp under hybrid sharding: the all-reduce between the replicas, after the "
                                        "reduce-scatters, is not timed")
            else:
                self.shard = shard_timer(self.clock, wrapped)

    def start_epoch(self, steps: int, measure: bool) -> None:
        """Where this epoch's windows and traced steps fall: after the warm-up when the epoch is long
        enough, else as late as they fit (the window first gives way). The `repeats` windows are
        spread evenly over the steps after the warm-up, as many as fit without overlapping, so that
        a slow spell anywhere in the epoch shows in the measured steps; the traced steps follow the
        first window."""
        self.overhead_s = 0.0
        self.steps = steps
        self.measure = bool(self.window) and measure
        self.traced = min(self.trace_steps, steps) if self.measure else 0
        self.first = min(self.warmup, max(0, steps - self.window - self.traced))
        self.measured = min(self.window, steps - self.first - self.traced) if self.measure else 0
        self.trace_start = self.first + self.measured
        self.window_steps = list(range(self.first, self.trace_start))
        room = steps - self.trace_start - self.traced  # the steps after the first window and the trace
        more = min(self.repeats - 1, room // self.measured) if self.measured else 0
        for index in range(1, more + 1):  # one window at the end of each of `more` equal slots
            start = self.trace_start + self.traced + room * index // more - self.measured
            self.window_steps += range(start, start + self.measured)
        self.windows = 1 + more if self.measured else 0
        self.in_windows = set(self.window_steps)
        # With one window the hook times it all (its steps and the steady ones carry the hook's cost).
        self.hook_from = self.window_steps[-self.measured] if self.windows > 1 else self.first
        alone = self.windows > 1 and self.hook_from > self.warmup
        self.steady_end = self.hook_from if alone else steps

    def in_window(self, step: int) -> bool:
        return step in self.in_windows

    def in_trace(self, step: int) -> bool:
        return self.traced > 0 and self.trace_start <= step < self.trace_start + self.traced

    def start_step(self, step: int) -> None:
        self.step = step
        if self.in_trace(step) and self.profiler is None:
            started = time.perf_counter()
            self.profiler = start_profiler(self.clock.cuda)
            self.overhead_s += time.perf_counter() - started
        window = self.in_window(step)
        if self.comm is not None:
            hooked = window and step >= self.hook_from
            if hooked and not self.comm.attached:
                self.comm.attach()
            self.comm.step = step if hooked else None
        self.dp_parts["recording"] = window
        if self.shard is not None:
            self.shard.step = step if window else None
        # The steady time runs from the first step after the warm-up to the end of the epoch's last.
        self.clock.start_step(step, stamped=window or step in (self.warmup, self.steps - 1) or not self.clock.cuda)
        self._range("data")

    def phase(self, name: str) -> None:
        self.clock.mark()
        self._range(name)

    def end_step(self) -> None:
        self.clock.mark()
        self._range(None)
        if self.shard is not None:  # evaluation's all-gathers are no step's
            self.shard.step = None
        if self.profiler is not None and not self.in_trace(self.step + 1):
            if self.clock.cuda:
                torch.cuda.synchronize()  # the traced steps' kernels are the steps' own time
            started = time.perf_counter()
            settle_collectives()
            self.profiler.stop()
            self.trace_file = export_trace(self.profiler, self.trace_dir, self.clock.cuda)
            self.profiler = None
            self.overhead_s += time.perf_counter() - started

    def _range(self, name: str | None) -> None:
        """The phase as a record_function range, on traced steps only (outside them it costs nothing)."""
        if self.open_range is not None:
            self.open_range.__exit__(None, None, None)
            self.open_range = None
        if name is not None and self.profiler is not None:
            self.open_range = torch.profiler.record_function(name)
            self.open_range.__enter__()

    def bucket_layout(self) -> list[dict]:
        """Each bucket of the window's steps (DDP's layout, after its rebuild): its size and when it
        was handed over, as a median fraction of the way through the backward's compute."""
        buckets: dict[int, dict] = {}
        for step in self.window_steps:
            marks = self.clock.step_marks(step)
            calls = [c for c in self.comm.calls if c[0] == step]
            if not calls:
                continue
            start = marks[2]  # the backward's start
            compute = max(self.clock.seconds(start, handed) for _, _, _, handed, _ in calls)
            for _, index, nbytes, handed, _ in calls:
                bucket = buckets.setdefault(index, {"index": index, "bytes": nbytes, "ready": []})
                bucket["ready"].append(self.clock.seconds(start, handed) / compute if compute > 0 else 1.0)
        return [{"index": b["index"], "bytes": b["bytes"], "ready_fraction": statistics.median(b["ready"])}
                for b in sorted(buckets.values(), key=lambda b: statistics.median(b["ready"]))]

    def sync_steps(self) -> dict[str, list[float]]:
        """DDP's steps as the ranks live them: from one step's gradients all-reduced (its last
        bucket's completion, the moment every rank leaves together) to the next's.
        `pre_sync_compute_s` is the part of that interval before this rank handed its last bucket
        over (its optimizer, data, forward and backward), so the slowest rank's at each step plus
        the communication after it is the step (scaling.predict)."""
        last: dict[int, tuple] = {}
        for step, _, _, handed, done in self.comm.calls:
            if done is not None and (step not in last or self.clock.seconds(last[step][0], handed) > 0):
                last[step] = (handed, done)
        steps = sorted(last)
        pairs = [(last[a], last[b]) for a, b in zip(steps, steps[1:]) if b == a + 1]
        return {"pre_sync_compute_s": [self.clock.seconds(a[1], b[0]) for a, b in pairs]}

    def steady_seconds(self) -> float | None:
        """The steady throughput's time: from the first step after the warm-up to the end of the
        epoch, or to the comm hook's first step when it has a window of its own."""
        if self.steady_end < self.steps:
            return self.clock.seconds_between(self.warmup, self.steady_end)
        return self.clock.seconds_since_step(self.warmup)

    def results(self) -> dict | None:
        """This epoch's window, per step and as medians (call before clock.totals())."""
        if not self.measured:
            return None
        rows = {}
        for step in self.window_steps:
            marks = self.clock.step_marks(step)
            phases = [self.clock.seconds(a, b) for a, b in zip(marks, marks[1:])]
            calls = self.comm.calls if self.comm else self.shard.calls if self.shard else ()  # alike from [3]: start, end
            comm = [(self.clock.seconds(marks[0], start), self.clock.seconds(marks[0], end))
                    for at, _, _, start, end in calls if at == step]
            rows[step] = step_breakdown(phases, comm, blocking=self.shard is not None)
        # DDP with windows to spare: the step times come from the windows without the hook, its
        # communication from the last window, which has it.
        apart = self.comm is not None and self.windows > 1
        steps = [row for step, row in rows.items() if not apart or step < self.hook_from]
        hooked = [row for step, row in rows.items() if step >= self.hook_from] if apart else steps
        median = {key: statistics.median(row[key] for row in steps) for key in steps[0]}
        if apart:
            for key in ("comm", "comm_overlapped", "comm_exposed"):
                median[key] = statistics.median(row[key] for row in hooked)
            median["backward_compute"] = median["backward"] - median["comm_exposed"]
            median["compute"] = median["step"] - median["comm_exposed"]
        out: dict[str, Any] = {"first_step": self.first, "steps": len(steps),
                               "windows": self.windows - 1 if apart else self.windows,
                               "hooked_steps": len(hooked) if self.comm else 0, "median_s": median,
                               # Each measured step's seconds, in order: pipeline.spread's intervals.
                               "step_s": [row["step"] for row in steps]}
        comm_total = sum(row["comm"] for row in hooked)
        out["comm_overlap_fraction"] = (sum(row["comm_overlapped"] for row in hooked) / comm_total
                                        if (self.comm or self.shard) and comm_total > 0 else None)
        if self.shard:
            out["collectives"] = self.shard.per_step(self.window_steps)
            self.shard.calls.clear()
        if self.comm_unmeasured:  # not a false 0: no communication figure at all
            out["comm_unmeasured"] = self.comm_unmeasured
            median.update(comm=None, comm_overlapped=None, comm_exposed=None, compute=None)
        if self.comm:
            out["buckets"] = self.bucket_layout()
            if not apart:  # else its window's compute is no sample of the others' (pipeline.scaling.predict)
                out.update(self.sync_steps())
            self.comm.calls.clear()
        if self.dp_parts.get("scatter"):  # on one GPU DataParallel only scatters, then calls the module
            out["dp_median_s"] = {part: statistics.median(self.clock.seconds(a, b) for a, b in self.dp_parts[part])
                                  for part in DP_PARTS if self.dp_parts[part]}
            for part in DP_PARTS:
                self.dp_parts[part].clear()
        return out


def start_profiler(cuda: bool):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:  # Kineto's errors stay visible: a CUPTI that cannot attach is the user's to know
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    else:
        # On the CPU Kineto prints a line at every start and stop (its level 5) and, from a CUDA
        # build, an ERROR for the missing GPU: 6 silences both.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def export_trace(profiler, folder: Path | None, cuda: bool) -> Path | None:
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = folder / f"trace-rank-{rank}.json"
    profiler.export_chrome_trace(str(path))
    if cuda and '"cat": "kernel"' not in path.read_text():
        log.warning("%s: the profiler recorded no GPU kernel (CUPTI unavailable, or taken by another "
                    "profiler?): the trace shows the CPU side only", path)
    return path


def settle_collectives() -> None:
    """Wait until gloo has ended every collective's profiler event. gloo completes a collective's
    future, which lets DDP's backward return, before its worker thread closes the collective's
    RecordFunction; a profiler stopped in between frees the event that thread then writes to (a
    heap corrupted at `profiler.stop()`, seen once in a full MNIST DDP training). gloo's barrier
    waits for every running and queued work of the group first. Every rank stops its trace at the
    same step (the trace's place comes from the global batch count), so all take part."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.barrier()


def timeline(trace_file: Path, rank: int, steps: int = 2) -> list[dict]:
    """The traced steps as bars to draw: [lane, name, start ms, duration ms] from the Chrome trace,
    times from the first phase's start. Lanes: the training thread's phases (and DataParallel's
    parts), the backend's collectives (on whatever thread or stream runs them), and each GPU's
    kernels (Kineto names the device of each: DataParallel's process runs kernels on every GPU)."""
    events = [e for e in json.loads(trace_file.read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    phases = [e for e in events if e["name"] in PHASES and e.get("cat") != "gpu_user_annotation"]
    if not phases:
        return []
    origin = min(e["ts"] for e in phases)
    bars = []
    for e in events:
        name = e["name"]
        if e.get("cat") == "gpu_user_annotation":  # a range's copy on the GPU's timeline: drawn once
            continue
        if name in PHASES or name.startswith("dp:"):
            lane = "phases" if name in PHASES else "DataParallel"
        elif name.startswith(COMM_EVENT_PREFIXES) and name != "gloo:barrier":  # settle_collectives' own
            lane = "collectives"
        elif e.get("cat") == "kernel":
            device = (e.get("args") or {}).get("device")
            lane = f"GPU {device} kernels" if device is not None else "GPU kernels"
        else:
            continue
        bars.append({"rank": rank, "lane": lane, "name": name, "start_ms": round((e["ts"] - origin) / 1000, 4),
                     "ms": round(e.get("dur", 0) / 1000, 4)})
    return sorted(bars, key=lambda bar: bar["start_ms"])
