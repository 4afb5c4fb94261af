"""Check and time every torch.distributed primitive, on the device training will use.

Each rank contributes small integers that depend on its rank and the element's position, so every
result has a closed form (a sum, a gather, a neighbour's tensor) that a rank can compare with what it
received without trusting the communication it is checking. The integers are bounded so that any sum
of any subset of ranks' values stays below 2**24: float32 holds every such partial sum exactly, and a
ring, a tree or any other reduction order gives the same bits. Timings follow nccl-tests, so its
users can read them side by side: warm-up iterations, then `iters` operations back to back between
one device sync and the next, their mean, the slowest rank's; nccl-tests' size (the whole buffer
of one chunk per rank for the gather, scatter and all-to-all family) and its algorithm and bus
bandwidths. The result is checked on one more operation of its own, from fresh inputs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from pipeline.parallel import Rank

PRIMITIVES = ("send_recv", "isend_irecv", "broadcast", "reduce", "all_reduce", "reduce_scatter", "scatter", "gather",
              "all_gather", "all_to_all", "barrier")
ELEMENT_BYTES = 4  # float32
EXACT_LIMIT = 2**24  # float32 represents every integer up to here
MAX_VALUE = 4096  # distinct values for up to 4096 ranks; fewer when more ranks must sum below EXACT_LIMIT
# A rank's point-to-point peer is another rank: with one rank there is none to talk to.
POINT_TO_POINT = ("send_recv", "isend_irecv")
# The ones whose per-rank buffer holds one chunk per peer: their message is the whole buffer.
CHUNKED = ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all")


def bus_factor(primitive: str, world_size: int) -> float:
    """busbw = algbw x this factor (nccl-tests' PERFORMANCE.md conventions)."""
    n = world_size
    if primitive == "all_reduce":
        return 2 * (n - 1) / n
    if primitive in CHUNKED:
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv


def message_bytes(primitive: str, per_rank_bytes: int, world_size: int) -> int:
    """The size nccl-tests divides by the time: the whole buffer of one chunk per rank for the
    gather, scatter and all-to-all family, one rank's buffer otherwise."""
    if primitive in CHUNKED:
        return per_rank_bytes * world_size
    return per_rank_bytes


def bandwidths(primitive: str, per_rank_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10**9 bytes, as nccl-tests prints them)."""
    algbw = message_bytes(primitive, per_rank_bytes, world_size) / seconds / 1e9
    return algbw, algbw * bus_factor(primitive, world_size)


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


def value_bound(world_size: int) -> int:
    """The largest value a rank contributes: world_size of them still sum exactly in float32."""
    return max(1, min(MAX_VALUE, (EXACT_LIMIT - 1) // world_size))


def expected_from(rank: int, numel: int, device, world_size: int, offset: int = 0) -> torch.Tensor:
    """What rank `rank` contributes at positions offset..offset+numel, computed in closed form on the
    receiving side: integers in 1..value_bound, different for every rank (up to the bound) and along
    the buffer, so a message from the wrong rank or at the wrong offset shows."""
    index = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    return ((index * (2 * rank + 1) + rank) % value_bound(world_size) + 1).to(torch.float32)


def total_of(numel: int, device, world_size: int, offset: int = 0) -> torch.Tensor:
    """The sum over every rank's contribution, in float64: exact, whatever the order."""
    return sum(expected_from(q, numel, device, world_size, offset).double() for q in range(world_size))


def contribution(primitive: str, rank: int, numel: int, device, world_size: int) -> torch.Tensor:
    values = expected_from(rank, numel, device, world_size)
    # Test hook: MNIST_PIPELINE_CORRUPT=<primitive>:<rank> makes that rank send wrong values, to
    # prove a broken link is caught and reported.
    if os.environ.get("MNIST_PIPELINE_CORRUPT") == f"{primitive}:{rank}":
        values += 1
    return values


@dataclass(frozen=True)
class Case:
    """One primitive at one size: `run` does the operation once from fresh inputs, `check` returns
    None or (expected, got) at the first wrong element."""

    setup: Callable[[], None]
    run: Callable[[], None]
    check: Callable[[], tuple[float, float, int] | None]


def _first_mismatch(got: torch.Tensor, expected: torch.Tensor):
    wrong = (got != expected).nonzero()
    if len(wrong) == 0:
        return None
    index = wrong[0].item()
    return expected[index].item(), got[index].item(), index


def make_case(primitive: str, rank: Rank, numel: int, device) -> Case:
    r, n = rank.rank, rank.world_size
    state: dict = {}

    def of(q: int, length: int = numel, offset: int = 0) -> torch.Tensor:
        return expected_from(q, length, device, n, offset)

    def fresh(length: int = numel) -> None:
        state["buf"] = contribution(primitive, r, length, device, n)

    if primitive == "broadcast":
        return Case(fresh, lambda: dist.broadcast(state["buf"], src=0), lambda: _first_mismatch(state["buf"], of(0)))
    if primitive == "reduce":
        return Case(fresh, lambda: dist.reduce(state["buf"], dst=0),
                    lambda: _first_mismatch(state["buf"], total_of(numel, device, n)) if r == 0 else None)
    if primitive == "all_reduce":
        return Case(fresh, lambda: dist.all_reduce(state["buf"]),
                    lambda: _first_mismatch(state["buf"], total_of(numel, device, n)))
    if primitive == "reduce_scatter":
        # Every rank holds one chunk per rank; rank r receives the sum of everyone's chunk r.
        def setup() -> None:
            fresh(numel * n)
            state["out"] = torch.empty(numel, device=device)
        return Case(setup, lambda: dist.reduce_scatter_single(state["out"], state["buf"]),
                    lambda: _first_mismatch(state["out"], total_of(numel, device, n, offset=r * numel)))
    if primitive == "all_to_all":
        # Rank q's chunk r goes to rank r, which holds them in rank order.
        def setup() -> None:
            fresh(numel * n)
            state["out"] = torch.empty(numel * n, device=device)
        return Case(setup, lambda: dist.all_to_all_single(state["out"], state["buf"]),
                    lambda: _first_mismatch(state["out"], torch.cat([of(q, offset=r * numel) for q in range(n)])))
    if primitive == "scatter":
        def setup() -> None:
            state["out"] = torch.empty(numel, device=device)
            state["chunks"] = [contribution(primitive, q, numel, device, n) for q in range(n)] if r == 0 else None
        return Case(setup, lambda: dist.scatter(state["out"], state["chunks"], src=0),
                    lambda: _first_mismatch(state["out"], of(r)))
    if primitive in ("gather", "all_gather"):
        def setup() -> None:
            fresh()
            receives = r == 0 or primitive == "all_gather"
            state["out"] = [torch.empty(numel, device=device) for _ in range(n)] if receives else None
        def run() -> None:
            if primitive == "gather":
                dist.gather(state["buf"], state["out"], dst=0)
            else:
                dist.all_gather(state["out"], state["buf"])
        def check():
            if state["out"] is None:
                return None
            expected = torch.cat([of(q) for q in range(n)])
            return _first_mismatch(torch.cat(state["out"]), expected)
        return Case(setup, run, check)
    if primitive in ("send_recv", "isend_irecv"):
        right, left = (r + 1) % n, (r - 1) % n
        def setup() -> None:
            fresh()
            state["out"] = torch.empty(numel, device=device)
        def run() -> None:
            if primitive == "isend_irecv":
                # One group, not two calls: NCCL (initialised eagerly, as `device_id` makes it) runs
                # unbatched point-to-point ops in order on one stream, so every rank's irecv would
                # wait for a send queued behind its peer's own irecv (tests/nccl_model.py).
                ops = [dist.P2POp(dist.irecv, state["out"], left), dist.P2POp(dist.isend, state["buf"], right)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            elif r % 2 == 0:  # blocking calls around a ring: alternate the order so none deadlocks
                dist.send(state["buf"], dst=right)
                dist.recv(state["out"], src=left)
            else:
                dist.recv(state["out"], src=left)
                dist.send(state["buf"], dst=right)
        return Case(setup, run, lambda: _first_mismatch(state["out"], of(left)))
    if primitive == "barrier":
        return Case(lambda: None, dist.barrier, lambda: None)
    raise ValueError(f"unknown primitive {primitive!r}")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(primitive: str, rank: Rank, per_rank_bytes: int, device, warmup: int, iters: int):
    """This rank's mean seconds per operation over `iters` back to back (nccl-tests' timing: one
    sync, not one per operation, so the launch overhead of one overlaps the last one's run), and
    its check of one more operation from fresh inputs. The timed operations reuse their buffers as
    nccl-tests does: an all_reduce multiplies its values by the world size each time, and may reach
    float32's infinity (which costs what any value costs), so the check runs on fresh inputs. A
    barrier before the timer, as nccl-tests has, keeps one rank's late start out of the others' time.
    Also the seconds of the first warm-up call (0 without warm-up): a primitive's first-call cost."""
    case = make_case(primitive, rank, max(1, per_rank_bytes // ELEMENT_BYTES), device)
    case.setup()
    first_call = 0.0
    for index in range(warmup):
        started = time.perf_counter()
        case.run()
        if index == 0:  # NCCL connects and loads its kernels lazily, on a primitive's first call
            _sync(device)
            first_call = time.perf_counter() - started
    dist.barrier()
    _sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        case.run()
    _sync(device)
    seconds = (time.perf_counter() - started) / iters
    case.setup()
    case.run()
    _sync(device)
    return seconds, case.check(), first_call


def checkable(world_size: int) -> tuple[str, ...]:
    """The primitives that mean something on `world_size` ranks (one GPU: no point-to-point)."""
    return PRIMITIVES if world_size > 1 else tuple(p for p in PRIMITIVES if p not in POINT_TO_POINT)


def sweep(rank: Rank, device, config, reach: dict[str, int] | None = None) -> dict:
    """Every primitive at every size on this rank: {"timings": [...], "failures": {primitive: ...}}.

    With `config.budget_s`, a primitive's sizes stop growing when the next one would overrun its
    share of the budget, except below `reach[primitive]` bytes (all_reduce up to the gradients DDP
    sends: the size the scaling model needs measured). The share leaves out each primitive's first
    call (`first_calls`): NCCL sets up its connections and loads its kernels then, which on GPUs
    could use up a share before the sizes whose bandwidth matters."""
    reach = reach or {}
    timings, failures, first_calls = [], {}, {}
    primitives = checkable(rank.world_size)
    with_payload = [p for p in primitives if p != "barrier"]
    share = config.budget_s / len(with_payload)
    for primitive in primitives:
        # A barrier carries no payload: one measurement, its latency.
        swept = [0] if primitive == "barrier" else sizes(config.min_bytes, config.max_bytes, config.factor)
        spent, previous = 0.0, None
        for i, size in enumerate(swept):
            started = time.perf_counter()
            seconds, mismatch, first_call = measure(primitive, rank, size, device, config.warmup, config.iters)
            took = time.perf_counter() - started
            if i == 0:  # the primitive's setup, once: reported apart, and no part of the sizes' budget
                first_calls[primitive] = first_call
                took -= first_call
            spent += took
            timings.append({"primitive": primitive, "bytes": size, "seconds": seconds})
            if mismatch and primitive not in failures:
                expected, got, index = mismatch
                failures[primitive] = {"bytes": size, "index": index, "expected": expected, "got": got}
            # The next size costs this one's time times the growth from the last size: about 1 while
            # latency rules, up to `factor` once bandwidth does. Every rank must stop at the same size
            # (a collective one rank skips hangs the others): the slowest rank's estimate decides.
            growth = min(config.factor, max(1.0, seconds / previous)) if previous else 1.0
            previous = seconds
            if config.budget_s and i + 1 < len(swept) and size >= reach.get(primitive, 0) and \
                    slowest(spent + took * growth, device) > share:
                break
    return {"rank": rank.rank, "timings": timings, "failures": failures, "first_calls": first_calls}


def slowest(seconds: float, device) -> float:
    """The largest of every rank's `seconds`."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def failure_message(per_rank: list[dict], backend: str) -> str | None:
    """One line per failed primitive, naming the ranks that received wrong values."""
    by_primitive: dict[str, list[str]] = {}
    for result in per_rank:
        for primitive, f in result["failures"].items():
            by_primitive.setdefault(primitive, []).append(
                f"rank {result['rank']} expected {f['expected']:g} at element {f['index']} of a "
                f"{f['bytes']}-byte message, got {f['got']:g}")
    if not by_primitive:
        return None
    lines = [f"{primitive} failed on {len(details)} of {len(per_rank)} ranks ({backend}): " + "; ".join(details)
             for primitive, details in by_primitive.items()]
    return "commcheck: " + "\n".join(lines)


def summarize(per_rank: list[dict], world_size: int) -> list[dict]:
    """Per primitive and size: the slowest rank's mean time, and nccl-tests' bandwidths."""
    rows = []
    for i, timing in enumerate(per_rank[0]["timings"]):
        seconds = max(result["timings"][i]["seconds"] for result in per_rank)
        algbw, busbw = (None, None) if timing["bytes"] == 0 else bandwidths(
            timing["primitive"], timing["bytes"], seconds, world_size)
        # `bytes`: one rank's buffer, what the sweep grows; `size_bytes`: nccl-tests' size column.
        rows.append({"primitive": timing["primitive"], "bytes": timing["bytes"],
                     "size_bytes": message_bytes(timing["primitive"], timing["bytes"], world_size),
                     "time_us": seconds * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw})
    return rows
