"""The scaling model checked on links we control: two emulated hosts (tests/hosts.py), their veth
link shaped with `tc tbf` at a rate (this kernel has no netem, so latency cannot be added: the
rate tests the model's per-byte term), commcheck measuring it, then DDP training 2 nodes × 1
process across it. Used by tests/test_shaped_links.py and benchmarks/shaped_links.py.

Each host shapes its own end (its egress), so each direction has its own queue; the shaped
traffic never leaves the namespaces the caller made.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import uuid
from pathlib import Path

from tests.conftest import SMALL, make_project, prepare, project_env, run, subprocess_env
from tests.hosts import INTERFACE, Host

RATES_MBIT = (None, 1000, 100)  # None: the veth as it is
RDZV_PORT = 29410
TIMEOUT_S = 300
# The small model's 0.8 MB of gradients in one bucket, ready when the backward ends: nothing hides
# its all-reduce, so the exposed share follows the link. A global batch of 512 makes each step's
# compute long against this shared machine's scheduling noise. One epoch of 50 steps, 40 of them
# measured (no trace: it would take 2 of them); commcheck times all_reduce up to 1 MiB.
PARAMS = {**SMALL, "data": {"train_limit": 25700, "val_size": 100}, "commcheck": {"max_bytes": 2**20, "iters": 5},
          "train": {**SMALL["train"], "batch_size": 512, "epochs": 1, "breakdown_steps": 40, "trace_steps": 0},
          "tracking": {"enabled": False}}


def label(mbit: int | None) -> str:
    return "unshaped" if mbit is None else f"{mbit} Mbit/s"


def shape(host: Host, mbit: int | None) -> None:
    """A token bucket on the host's end of the link, or none. Its burst is 10 ms at the rate, well
    above the rate/HZ a tbf needs to reach its rate."""
    base = ["ip", "netns", "exec", host.netns, "tc", "qdisc"]
    subprocess.run([*base, "del", "dev", INTERFACE, "root"], capture_output=True)  # none there: fine
    if mbit is not None:
        burst = max(16 * 1024, mbit * 1_000_000 // 8 // 100)
        subprocess.run([*base, "add", "dev", INTERFACE, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
                        "latency", "100ms"], check=True, capture_output=True, text=True)


def prepared_project(root: Path, mnist_dir: Path) -> Path:
    project = make_project(root / "proj", PARAMS)
    prepare(project, mnist_dir)
    return project


def node_dirs(project: Path, root: Path) -> list[Path]:
    """One working directory per node, each with its own copy of the code and the prepared data."""
    return [shutil.copytree(project, root / name, ignore=shutil.ignore_patterns("models", "results", "plots"))
            for name in ("node-a", "node-b")]


def torchrun_on_two_hosts(hosts: list[Host], dirs: list[Path], command: list[str], logs: Path) -> list[str]:
    """`python -m stages <command>` as 2 nodes × 1 process, one torchrun agent per host; each
    host's output."""
    job = uuid.uuid4().hex[:8]
    procs = []
    for host, folder in zip(hosts, dirs):
        argv = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{hosts[0].address}:{RDZV_PORT}", "--rdzv-id", job,
                "--rdzv-conf", f"is_host={int(host is hosts[0])}", "--local-addr", host.address,
                "-m", "stages", *command]
        # gloo on the shaped interface, not on loopback.
        procs.append(host.popen(argv, cwd=folder, log=logs / f"{host.name}-{job}.log",
                                env=subprocess_env(**project_env(folder, GLOO_SOCKET_IFNAME=INTERFACE))))
    outputs = []
    for host, proc in zip(hosts, procs):
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in procs:
                os.killpg(other.pid, 9)
            proc.wait()
        outputs.append((logs / f"{host.name}-{job}.log").read_text())
    for host, proc, out in zip(hosts, procs, outputs):
        assert proc.returncode == 0, f"{host.name}: {' '.join(command)} exited {proc.returncode}:\n{out[-4000:]}"
    return outputs


def rank0_dir(dirs: list[Path], path: str) -> Path:
    (found,) = [d for d in dirs if (d / path).is_file()]
    return found


def measure(hosts: list[Host], dirs: list[Path], mbit: int | None, logs: Path) -> dict:
    """Shape the link, let commcheck measure it, train DDP across it; the breakdown and what the
    scaling model predicted for it."""
    from pipeline import scaling, spread

    for host in hosts:
        shape(host, mbit)
    for folder in dirs:
        for stale in ("results", "models"):
            shutil.rmtree(folder / stale, ignore_errors=True)
    torchrun_on_two_hosts(hosts, dirs, ["commcheck"], logs)
    comm = rank0_dir(dirs, "results/comm.json") / "results/comm.json"
    for folder in dirs:  # training's rank 0 may be on the other node: it reads the link there
        if not (folder / "results/comm.json").is_file():
            (folder / "results").mkdir(exist_ok=True)
            shutil.copy(comm, folder / "results/comm.json")
    torchrun_on_two_hosts(hosts, dirs, ["train", "--mode", "ddp"], logs)
    breakdown = json.loads((rank0_dir(dirs, "results/breakdown/ddp.json") / "results/breakdown/ddp.json").read_text())
    link = scaling.measured_link(breakdown["link"]) if breakdown.get("link") else None
    prediction = scaling.predict(breakdown, link)
    # The step's communication once every rank was ready (a faster rank's wait for the slowest is
    # not communication): the median step less the median compute of each step's slowest rank.
    ready, steps = scaling.slowest_pre_sync(breakdown), spread.step_series(breakdown)
    step = statistics.median(steps)
    exposed = step - statistics.median(ready)
    # How far this machine's noise moves that share: the standard errors of the two medians.
    noise = (median_error(steps) + median_error(ready)) / step
    return {"link": label(mbit), "mbit": mbit, "breakdown": breakdown, "share_noise": noise,
            # None with no link, or one whose sweep showed latency alone (no slope: no bandwidth seen).
            "link_busbw_gbps": 2 / link.per_byte_s / 1e9 if link and link.per_byte_s else None,
            "measured_step_s": step, "comm_exposed_s": exposed, "exposed_share": exposed / step,
            "prediction": prediction}


def median_error(values: list[float]) -> float:
    """The standard error of a sample's median, 1.2533 σ / √n (for a normal sample)."""
    return 1.2533 * statistics.stdev(values) / len(values) ** 0.5
