"""What else the host ran while a mode trained: the busy time of the CPUs this process may run on
(/proc/stat, per CPU) less the training's own CPU time, over the epoch's wall time; and on GPUs,
the compute processes NVML lists on the training's devices at the epoch's end beyond the ranks'
own. A shared machine's other jobs show here as cores or devices taken from the mode, which its
step times alone cannot tell from a slow mode."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

# /proc/stat's columns, in USER_HZ: user nice system idle iowait irq softirq steal (guest is in
# user). Busy: user, nice, system and steal (another guest on the hypervisor, as disturbing as
# another process); irq and softirq are left out, since the training's own loopback traffic
# (gloo) lands there and no process's CPU time holds it.
BUSY_COLUMNS = (0, 1, 2, 7)


def cpus() -> tuple[int, ...]:
    if not hasattr(os, "sched_getaffinity"):
        return tuple(range(os.cpu_count() or 1))
    return tuple(sorted(os.sched_getaffinity(0)))


def busy_seconds(allowed: tuple[int, ...]) -> dict[int, float] | None:
    """Seconds each of the `allowed` CPUs spent busy since boot; None where /proc/stat cannot be
    read or does not list them all (lxcfs renumbers the CPUs a container sees)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{index}": index for index in allowed}
    found = {}
    for line in lines:
        name, *columns = line.split() or [""]
        if name in wanted:
            found[wanted[name]] = sum(int(columns[i]) for i in BUSY_COLUMNS if i < len(columns)) \
                / os.sysconf("SC_CLK_TCK")
    return found if len(found) == len(wanted) else None


def gpu_uuids(indices: list[int]) -> list[str]:
    """NVML's names ("GPU-<uuid>") of this process's CUDA devices: NVML counts devices from the
    hardware, CUDA from CUDA_VISIBLE_DEVICES, so only the UUID names the same device in both."""
    import torch

    return [f"GPU-{torch.cuda.get_device_properties(index).uuid}" for index in indices]


def gpu_processes(uuids: list[str]) -> dict[str, int] | None:
    """How many compute processes NVML lists on each device (ours among them); None without NVML
    or where it cannot say (a MIG device, a container whose NVML cannot start)."""
    if not uuids:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver library, or NVML that cannot start: nothing to say
        return None
    try:
        return {uuid: len(pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByUUID(uuid)))
                for uuid in uuids}
    except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError):  # an older driver lacks the _v3 call
        return None
    finally:
        pynvml.nvmlShutdown()


class Sample:
    """Taken at an epoch's start; `finish` at its end gives this process's share of the record.
    `gpus`: the NVML names of the devices this process trains on (gpu_uuids), if any."""

    def __init__(self, gpus: list[str] | None = None):
        self.cpus = cpus()
        self.gpus = gpus or []
        self.busy = busy_seconds(self.cpus)
        self.own = time.process_time()  # every thread of this process

    def finish(self) -> dict:
        busy = busy_seconds(self.cpus)
        return {"host": socket.gethostname(), "cpus": self.cpus,
                "busy_s": (None if busy is None or self.busy is None
                           else {cpu: busy[cpu] - self.busy[cpu] for cpu in self.cpus}),
                "own_s": time.process_time() - self.own, "loadavg_1m": os.getloadavg()[0],
                "gpu_processes": gpu_processes(self.gpus)}


def gpu_others(ranks: list[dict]) -> int | None:
    """Compute processes on the host's training devices beyond the ranks': each device has one
    process of ours for each rank that trains on it. Counted, not matched by pid: in a container
    NVML gives the host's pids, which are not the ones the ranks see."""
    seen: dict[str, int] = {}
    ours: dict[str, int] = {}
    for rank in ranks:
        if rank.get("gpu_processes") is None:
            continue
        for uuid, count in rank["gpu_processes"].items():
            seen[uuid] = count
            ours[uuid] = ours.get(uuid, 0) + 1
    return sum(max(0, count - ours[uuid]) for uuid, count in seen.items()) if seen else None


def others(samples: list[dict], wall_s: float) -> dict | None:
    """The busiest host's other work, from every rank's `Sample.finish()`: cores kept busy by
    processes other than the ranks (ranks of one host on the same CPUs count those CPUs once), the
    cores the ranks could use, the host's 1-minute load average at the end, and other compute
    processes on the ranks' GPUs then (None without GPUs or NVML)."""
    hosts: dict[str, list[dict]] = {}
    for sample in samples:
        hosts.setdefault(sample["host"], []).append(sample)
    worst = None
    for ranks in hosts.values():
        if wall_s <= 0 or any(r["busy_s"] is None for r in ranks):
            return None
        # Each CPU once, however many ranks of this host may run on it.
        busy = {cpu: seconds for r in ranks for cpu, seconds in r["busy_s"].items()}
        cores = len(busy)
        taken = max(0.0, (sum(busy.values()) - sum(r["own_s"] for r in ranks)) / wall_s)
        found = {"others_cores": round(min(taken, cores), 2), "cores": cores,
                 "loadavg_1m": round(max(r["loadavg_1m"] for r in ranks), 2),
                 "others_gpu_processes": gpu_others(ranks)}
        if worst is None or (found["others_gpu_processes"] or 0, found["others_cores"]) > \
                (worst["others_gpu_processes"] or 0, worst["others_cores"]):
            worst = found
    return worst
