"""The scaling model: a mode's step time from its measured parts, and DDP's at N ranks on a link.

Communication follows the ring all-reduce of Thakur, Rabenseifner and Gropp (2005): for p ranks
and n bytes, 2(p-1)·α + (p-1)/p·n·(2β + γ), α the latency of one ring step, β the time per byte on
the wire, γ the reduction's compute per byte (which matters for gloo on a CPU). nccl-tests' bus
bandwidth is the factor 2(p-1)/p times n/t, so on a link of bus bandwidth B, 2β + γ = 2/B when the
reduction is free (GPUs). A link is therefore two numbers: α, and c = 2β + γ.

DDP: each gradient bucket is handed to the backend once its gradients are ready, at the measured
fraction of the way through the backward's compute; the backend reduces the buckets one after
another; whatever is still running when the backward's compute ends is exposed. The ranks meet
in every all-reduce, so a step, from one all-reduce's end to the next's, is the compute of the
rank slowest to hand its last bucket over, plus that exposed communication. Where the comm timer
had a window of its own (pipeline.breakdown), the compute is the measured steps' less the exposed
all-reduce that window saw.

DataParallel (one process, several GPUs): the forward is scatter + replicate + replicas + gather,
each measured on GPU 0's stream. So "replicas" is GPU 0's replica, and gather holds the wait for
the other GPUs' replicas where they end later: gather's time beyond scatter's (which moves the
input batch, more bytes than the outputs gather brings back) counts as replica compute. At N GPUs
replicate grows with N, the replicas' compute (that wait included) shrinks with the per-GPU batch,
scatter and the rest of gather move the same bytes. The backward (with the gradient reduce onto
GPU 0) and the optimizer are kept as measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pipeline import spread


@dataclass(frozen=True)
class Link:
    name: str
    latency_s: float  # α, per ring step
    per_byte_s: float  # c = 2β + γ, per byte of the buffer
    source: str

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) * self.latency_s + (ranks - 1) / ranks * nbytes * self.per_byte_s


def measured_link(comm: dict) -> Link | None:
    """The link commcheck measured: its all_reduce sweep at its world size p0, fitted as
    t = A + B·n. B, the per-byte slope, is the least-squares slope over the messages of 16 KiB and
    more, where bandwidth shows; A = 2(p0-1)·α is the median of t - B·n over the messages of
    16 KiB and less, where latency rules (the median: one slow call does not move it)."""
    points = [(r["bytes"], r["time_us"] / 1e6) for r in comm.get("sweep", []) if r["primitive"] == "all_reduce"]
    ranks = comm.get("world_size") or 0
    large = [(n, t) for n, t in points if n >= 16384]
    if ranks < 2 or len(large) < 2 or max(n for n, _ in large) < 65536:
        return None  # latency-bound all the way: it says nothing about the bandwidth
    mean_n = statistics.fmean(n for n, _ in large)
    mean_t = statistics.fmean(t for _, t in large)
    slope = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in large) / sum((n - mean_n) ** 2 for n, _ in large))
    small = [(n, t) for n, t in points if n <= 16384] or [min(points)]  # commcheck.min_bytes may be larger
    latency = max(0.0, statistics.median(t - slope * n for n, t in small))
    largest = max(n for n, _ in points)
    return Link("commcheck", latency / (2 * (ranks - 1)), slope * ranks / (ranks - 1),
                f"commcheck's all_reduce sweep ({ranks} ranks, {comm.get('backend')}, up to {largest} bytes)")


def named_link(name: str, busbw_gbps: float, latency_us: float) -> Link:
    return Link(name, latency_us / 1e6, 2 / (busbw_gbps * 1e9), f"{busbw_gbps:g} GB/s bus bandwidth, {latency_us:g} us")


def ddp_exposed_s(buckets: list[dict], backward_compute_s: float, link: Link, ranks: int) -> tuple[float, float]:
    """(communication, exposed communication) of one step: the buckets reduced in the order they
    become ready, one at a time."""
    end = total = 0.0
    for bucket in sorted(buckets, key=lambda b: b["ready_fraction"]):
        took = link.allreduce_s(bucket["bytes"], ranks)
        end = max(end, bucket["ready_fraction"] * backward_compute_s) + took
        total += took
    return total, max(0.0, end - backward_compute_s)


def fsdp_comm_s(collectives: dict, link: Link, ranks: int) -> float:
    """FSDP2's all-gathers and reduce-scatters of one step, at the calls and bytes a step the CPU's
    breakdown measured (pipeline.breakdown; a GPU's are not): an all-gather as half the ring, each
    call (p-1)·α and its whole buffer's n bytes (p-1)/p·n·c/2, c the link's 2β+γ; a reduce-scatter
    as the whole ring all-reduce, as gloo makes it (ProcessGroupGloo's reduce-scatter all-reduces a
    copy of the input and keeps its rank's chunk)."""
    gather, scatter = collectives["all_gather"], collectives["reduce_scatter"]
    share = (ranks - 1) / ranks * link.per_byte_s
    return (gather["calls"] * (ranks - 1) * link.latency_s + share * gather["bytes"] / 2
            + scatter["calls"] * 2 * (ranks - 1) * link.latency_s + share * scatter["bytes"])


def slowest_rank(breakdown: dict) -> dict | None:
    """The rank whose median step was longest: a synchronous step goes at its pace."""
    ranks = breakdown.get("ranks") or []
    return max(ranks, key=lambda r: r["median_s"]["step"]) if ranks else None


def slowest_pre_sync(breakdown: dict) -> list[float] | None:
    """Each step's pre-sync compute on whichever rank was slowest at it, from the ranks' DDP step
    records (breakdown.Probe.sync_steps): the ranks meet in every all-reduce, so a step goes at its
    straggler's pace, and the faster ranks' exposed communication is mostly waiting for it. None
    when the ranks' records do not line up."""
    ranks = breakdown.get("ranks") or []
    pre = [r.get("pre_sync_compute_s") for r in ranks]
    if not pre or None in pre or len({len(p) for p in pre}) != 1 or not pre[0]:
        return None
    return [max(step) for step in zip(*pre)]


def predict(breakdown: dict, link: Link | None) -> dict | None:
    """Predicted against measured median step (pipeline.spread's one definition), for the
    configuration that ran."""
    rank = slowest_rank(breakdown)
    if rank is None:
        return None
    m = rank["median_s"]
    series = spread.step_series(breakdown)
    measured = statistics.median(series) if series else m["step"]
    if breakdown["mode"] == "ddp" and breakdown["world_size"] > 1:
        if link is None:
            return None
        comm, exposed = ddp_exposed_s(rank.get("buckets", []), m["backward_compute"], link, breakdown["world_size"])
        pre_sync = slowest_pre_sync(breakdown)
        if pre_sync is not None:  # from all-reduce to all-reduce: the slowest rank's compute, then the communication
            predicted = statistics.median(pre_sync) + exposed
        elif series and rank.get("buckets"):
            # The comm timer had a window of its own (pipeline.breakdown): the measured steps, each on
            # the rank slowest at it, with the all-reduce they waited for (its window's median)
            # replaced by the model's.
            predicted = measured - m["comm_exposed"] + exposed
        else:
            predicted = m["compute"] + exposed
    elif breakdown["mode"] == "fsdp" and breakdown["world_size"] > 1:
        if link is None or not rank.get("collectives"):  # a GPU's are not measured (pipeline.breakdown)
            return None
        # The CPU's collectives hold the training thread: all of them exposed, the rest compute.
        comm = exposed = fsdp_comm_s(rank["collectives"], link, breakdown["world_size"])
        predicted = measured - m["comm_exposed"] + exposed
    elif len(rank.get("dp_median_s") or {}) == 4:  # DataParallel over 2 or more GPUs
        parts = rank["dp_median_s"]
        comm, exposed = parts["scatter"] + parts["gather"], 0.0
        # Its forward rebuilt from its four measured parts (the loss, outside them, is left out).
        predicted = m["data"] + sum(parts.values()) + m["backward"] + m["optimizer"]
    else:  # one device: no communication; the step is its phases
        comm, exposed = 0.0, 0.0
        predicted = m["data"] + m["forward"] + m["backward"] + m["optimizer"]
    return {"mode": breakdown["mode"], "world_size": breakdown["world_size"], "measured_step_s": measured,
            "predicted_step_s": predicted, "predicted_comm_s": comm, "predicted_exposed_s": exposed,
            "prediction_error": predicted / measured - 1 if measured > 0 else None}


def per_rank_batch(breakdown: dict) -> int:
    """The largest share of the global batch any rank or GPU took ("43/43/42" -> 43)."""
    return max(int(x) for x in str(breakdown["batch_shares"]).split("/"))


def project_ddp(breakdown: dict, link: Link, devices: int) -> dict | None:
    """DDP at `devices` ranks, each with the per-rank batch it ran (weak scaling: the global batch
    grows with the devices) and the compute one of these ranks measured."""
    rank = slowest_rank(breakdown)
    if rank is None or not rank.get("buckets"):
        return None
    m = rank["median_s"]
    comm, exposed = ddp_exposed_s(rank["buckets"], m["backward_compute"], link, devices)
    step = m["compute"] + exposed
    batch = per_rank_batch(breakdown)
    return {"link": link.name, "devices": devices, "step_s": step, "comm_s": comm, "exposed_s": exposed,
            "samples_per_s": devices * batch / step, "scaling_efficiency": m["compute"] / step,
            "global_batch": devices * batch}


def project_dp(breakdown: dict, devices: int) -> dict | None:
    """DataParallel at `devices` GPUs of one machine, from its measured parts (see the module's doc)."""
    rank = slowest_rank(breakdown)
    if rank is None or not rank.get("dp_median_s"):
        return None
    n, m = breakdown["dp_devices"], rank["median_s"]
    parts = {part: rank["dp_median_s"].get(part, 0.0) for part in ("scatter", "replicate", "replicas", "gather")}
    if n < 2:  # one GPU: DataParallel calls the module itself, there is nothing to scale from
        return None
    waited = max(0.0, parts["gather"] - parts["scatter"])  # the other GPUs' replicas, ending after GPU 0's
    step = (m["data"] + parts["scatter"] + parts["replicate"] * devices / n
            + (parts["replicas"] + waited) * n / devices + parts["gather"] - waited + m["backward"] + m["optimizer"])
    return {"link": "one machine", "devices": devices, "step_s": step,
            "samples_per_s": breakdown["batch_size"] / step, "global_batch": breakdown["batch_size"]}


ASSUMPTIONS = (
    "Compute per step is what the run measured (data, forward, backward less its exposed communication, "
    "optimizer), on the slowest rank; a projected device computes as fast as one of these ranks did.",
    "Projections keep each rank's batch as DDP ran it (weak scaling): the global batch grows with the devices, "
    "so the learning rate and the number of steps would need retuning to train the same model.",
    "All-reduce: the ring formula 2(p-1)·α + (p-1)/p·n·(2β+γ); the buckets are reduced one at a time in the "
    "order they became ready. NCCL uses trees at scale, so the latency term is pessimistic at 512 devices.",
    "fsdp: each all-gather as half the ring, (p-1)·α + (p-1)/p·n·(2β+γ)/2, each reduce-scatter as gloo makes it, "
    "a whole ring all-reduce, at the calls and bytes a step it measured on the CPU; all exposed there, where "
    "FSDP2 makes each on the training thread.",
    "commcheck's link: 2β+γ from the slope of its all_reduce times from 16 KiB up, α from the times up to 16 KiB; a named link: "
    "its bus bandwidth and latency as given in params.yaml (compare.link_*), with γ = 0 (GPUs reduce at memory speed).",
    "No contention: the devices' links do not share a switch's bandwidth, and communication does not slow "
    "the compute it overlaps (on a 2-core CPU, gloo's threads do).",
)
