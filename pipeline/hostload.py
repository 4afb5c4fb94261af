"""What else the host ran while a mode trained: the busy time of the CPUs this process may run on
(/proc/stat, per CPU) less the training's own CPU time, over the epoch's wall time. A shared
machine's other jobs show here as cores taken from the mode, which its step times alone cannot
tell from a slow mode."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

# /proc/stat's columns, in USER_HZ: user nice system idle iowait irq softirq steal (guest is in user).
BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def cpus() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def busy_seconds(allowed: tuple[int, ...]) -> float | None:
    """Seconds the `allowed` CPUs spent busy since boot (None where /proc/stat cannot be read)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{index}" for index in allowed}
    ticks = 0
    for line in lines:
        name, *columns = line.split()
        if name in wanted:
            ticks += sum(int(columns[i]) for i in BUSY_COLUMNS if i < len(columns))
    return ticks / os.sysconf("SC_CLK_TCK")


class Sample:
    """Taken at an epoch's start; `finish` at its end gives this process's share of the record."""

    def __init__(self):
        self.cpus = cpus()
        self.busy = busy_seconds(self.cpus)
        self.own = time.process_time()  # every thread of this process

    def finish(self) -> dict:
        busy = busy_seconds(self.cpus)
        return {"host": socket.gethostname(), "cpus": self.cpus,
                "busy_s": None if busy is None or self.busy is None else busy - self.busy,
                "own_s": time.process_time() - self.own, "loadavg_1m": os.getloadavg()[0]}


def others(samples: list[dict], wall_s: float) -> dict | None:
    """The busiest host's other work, from every rank's `Sample.finish()`: cores kept busy by
    processes other than the ranks (ranks of one host on the same CPUs count those CPUs once), the
    cores the ranks could use, and the host's 1-minute load average at the end."""
    hosts: dict[str, list[dict]] = {}
    for sample in samples:
        hosts.setdefault(sample["host"], []).append(sample)
    worst = None
    for ranks in hosts.values():
        if wall_s <= 0 or any(r["busy_s"] is None for r in ranks):
            return None
        by_cpus = {tuple(r["cpus"]): r["busy_s"] for r in ranks}
        cores = len({cpu for r in ranks for cpu in r["cpus"]})
        taken = max(0.0, (sum(by_cpus.values()) - sum(r["own_s"] for r in ranks)) / wall_s)
        found = {"others_cores": round(min(taken, cores), 2), "cores": cores,
                 "loadavg_1m": round(max(r["loadavg_1m"] for r in ranks), 2)}
        if worst is None or found["others_cores"] > worst["others_cores"]:
            worst = found
    return worst
