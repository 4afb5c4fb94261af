"""Check and time every torch.distributed primitive, on the device training will use.

Each rank contributes `arange(numel) + 1000 * (rank + 1)`, so every result has a closed form
(a sum, a gather, a neighbour's tensor) that a rank can compare with what it received without
trusting the communication it is checking. Timings follow nccl-tests: warm-up, a device sync around
each operation, the median of several iterations, the slowest rank's median, and the same algorithm
and bus bandwidth conventions.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from pipeline.parallel import Rank

PRIMITIVES = ("send_recv", "isend_irecv", "broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather",
              "barrier")
ELEMENT_BYTES = 4  # float32: exact for every integer value the checks produce below 2**24
BASE = 1000.0


def bus_factor(primitive: str, world_size: int) -> float:
    """busbw = algbw x this factor (nccl-tests' PERFORMANCE.md conventions)."""
    n = world_size
    if primitive == "all_reduce":
        return 2 * (n - 1) / n
    if primitive in ("all_gather", "reduce_scatter", "gather", "scatter"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv


def message_bytes(primitive: str, per_rank_bytes: int, world_size: int) -> int:
    """The size nccl-tests divides by the time: the whole gathered or scattered buffer for the
    gather family, one rank's buffer otherwise."""
    if primitive in ("all_gather", "gather", "scatter"):
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


def expected_from(rank: int, numel: int, device) -> torch.Tensor:
    """What rank `rank` contributes, computed in closed form on the receiving side."""
    return torch.arange(numel, dtype=torch.float32, device=device) + BASE * (rank + 1)


def contribution(primitive: str, rank: int, numel: int, device) -> torch.Tensor:
    values = expected_from(rank, numel, device)
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

    def total() -> torch.Tensor:
        return sum(expected_from(q, numel, device) for q in range(n))

    def fresh() -> None:
        state["buf"] = contribution(primitive, r, numel, device)

    if primitive == "broadcast":
        return Case(fresh, lambda: dist.broadcast(state["buf"], src=0),
                    lambda: _first_mismatch(state["buf"], expected_from(0, numel, device)))
    if primitive == "reduce":
        return Case(fresh, lambda: dist.reduce(state["buf"], dst=0),
                    lambda: _first_mismatch(state["buf"], total()) if r == 0 else None)
    if primitive == "all_reduce":
        return Case(fresh, lambda: dist.all_reduce(state["buf"]), lambda: _first_mismatch(state["buf"], total()))
    if primitive == "scatter":
        def setup() -> None:
            state["out"] = torch.empty(numel, device=device)
            state["chunks"] = [contribution(primitive, q, numel, device) for q in range(n)] if r == 0 else None
        return Case(setup, lambda: dist.scatter(state["out"], state["chunks"], src=0),
                    lambda: _first_mismatch(state["out"], expected_from(r, numel, device)))
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
            expected = torch.cat([expected_from(q, numel, device) for q in range(n)])
            return _first_mismatch(torch.cat(state["out"]), expected)
        return Case(setup, run, check)
    if primitive in ("send_recv", "isend_irecv"):
        right, left = (r + 1) % n, (r - 1) % n
        def setup() -> None:
            fresh()
            state["out"] = torch.empty(numel, device=device)
        def run() -> None:
            if primitive == "isend_irecv":
                for work in (dist.irecv(state["out"], src=left), dist.isend(state["buf"], dst=right)):
                    work.wait()
            elif r % 2 == 0:  # blocking calls around a ring: alternate the order so none deadlocks
                dist.send(state["buf"], dst=right)
                dist.recv(state["out"], src=left)
            else:
                dist.recv(state["out"], src=left)
                dist.send(state["buf"], dst=right)
        return Case(setup, run, lambda: _first_mismatch(state["out"], expected_from(left, numel, device)))
    if primitive == "barrier":
        return Case(lambda: None, dist.barrier, lambda: None)
    raise ValueError(f"unknown primitive {primitive!r}")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(primitive: str, rank: Rank, per_rank_bytes: int, device, warmup: int, iters: int):
    """This rank's median seconds per operation, and its check of the last result."""
    case = make_case(primitive, rank, max(1, per_rank_bytes // ELEMENT_BYTES), device)
    times = []
    for i in range(warmup + iters):
        case.setup()
        _sync(device)
        started = time.perf_counter()
        case.run()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times), case.check()


def sweep(rank: Rank, device, config) -> dict:
    """Every primitive at every size on this rank: {"timings": [...], "failures": {primitive: ...}}."""
    timings, failures = [], {}
    for primitive in PRIMITIVES:
        # A barrier carries no payload: one measurement, its latency.
        for size in [0] if primitive == "barrier" else sizes(config.min_bytes, config.max_bytes, config.factor):
            seconds, mismatch = measure(primitive, rank, size, device, config.warmup, config.iters)
            timings.append({"primitive": primitive, "bytes": size, "seconds": seconds})
            if mismatch and primitive not in failures:
                expected, got, index = mismatch
                failures[primitive] = {"bytes": size, "index": index, "expected": expected, "got": got}
    return {"rank": rank.rank, "timings": timings, "failures": failures}


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
    """Per primitive and size: the slowest rank's median time, and nccl-tests' bandwidths."""
    rows = []
    for i, timing in enumerate(per_rank[0]["timings"]):
        seconds = max(result["timings"][i]["seconds"] for result in per_rank)
        algbw, busbw = (None, None) if timing["bytes"] == 0 else bandwidths(
            timing["primitive"], timing["bytes"], seconds, world_size)
        rows.append({"primitive": timing["primitive"], "bytes": timing["bytes"], "time_us": seconds * 1e6,
                     "algbw_gbps": algbw, "busbw_gbps": busbw})
    return rows
