"""commcheck: every torch.distributed primitive checked and timed -> results/comm.json (the sweep),
checks/comm.json (the verdict training depends on).

It checks what DDP and FSDP use: with neither in train.modes nothing in the run uses
torch.distributed, so it starts no workers and leaves the last verdict as it was (nothing retrains for it)."""

import socket
from pathlib import Path

import click

from pipeline import comm, parallel
from pipeline.atomic import write_json
from pipeline.config import Config, WorkloadConfig, flatten, load_config
from pipeline.workloads import load_workload, workload_of
from pipeline.tracking.runs import start_mode_run, until_done
from pipeline.tracking.bucket import check_node_artifacts
from pipeline.tracking.store import check_store, check_worker_store, tracking_uri
from stages.common import echo_detail, params_option, verbose
from stages import slurm
from stages.workers import launch_workers, run_facts

RESULTS_FILE = Path("results/comm.json")
# What training depends on: the verdict alone, which stays the same run after run on the same
# hardware (timings do not). The stage runs on every `dvc repro` (always_changed: the hardware is no
# file DVC can hash), and training reruns only when the verdict changes.
VERDICT_FILE = Path("checks/comm.json")
LOG_DIR = Path("checks/logs")  # the Slurm job's output, with train.launcher: slurm


def table(rows: list[dict]) -> str:
    lines = [f"{'primitive':<12} {'bytes/rank':>10} {'size':>10} {'time (us)':>11} {'algbw (GB/s)':>13} "
             f"{'busbw (GB/s)':>13}"]
    def bandwidth(value) -> str:
        return f"{'-':>13}" if value is None else f"{value:>13.4f}"

    lines += [f"{r['primitive']:<12} {r['bytes']:>10} {r['size_bytes']:>10} {r['time_us']:>11.1f} {bandwidth(r['algbw_gbps'])} "
              f"{bandwidth(r['busbw_gbps'])}" for r in rows]
    return "\n".join(lines)


def per_primitive(rows: list[dict], primitives: tuple[str, ...], per_rank: list[dict]) -> dict:
    """Each primitive's verdict and figures; `first_call_us`: the slowest rank's first call, where
    NCCL sets up (kept out of the sweep's budget and of every timing)."""
    summary = {}
    for primitive in primitives:
        mine = [r for r in rows if r["primitive"] == primitive]
        summary[primitive] = {"passed": True, "latency_us": mine[0]["time_us"],
                              "first_call_us": max(r["first_calls"][primitive] for r in per_rank) * 1e6}
        if primitive != "barrier":
            summary[primitive]["largest_bytes"] = mine[-1]["bytes"]
            summary[primitive]["peak_algbw_gbps"] = max(r["algbw_gbps"] for r in mine)
            summary[primitive]["peak_busbw_gbps"] = max(r["busbw_gbps"] for r in mine)
    return summary


def gradient_bytes(workload: WorkloadConfig) -> int:
    """What DDP all-reduces each step: the workload's model's float32 gradients."""
    return sum(p.numel() * 4 for p in load_workload(workload).build_model().parameters() if p.requires_grad)


def run_worker(config: Config) -> None:
    rank = parallel.rank_from_env()
    device = parallel.pick_device(rank, config.train.device)
    if device.type == "cpu":
        parallel.limit_cpu_threads(rank)
    backend = parallel.backend_for(device)
    if config.tracking.enabled:
        check_worker_store(rank)
        check_node_artifacts(rank, config.tracking)
    with parallel.process_group(rank, device):
        params = {k: v for k, v in flatten(config).items() if k.startswith("commcheck.")}
        runs = start_mode_run(config.tracking, "commcheck", rank,
                              run_facts("commcheck", rank, device, distributed=True), params)
        with until_done(runs):
            mine = comm.sweep(rank, device, config.commcheck, reach={"all_reduce": gradient_bytes(config.workload)})
            per_rank = parallel.all_gather_objects(mine, rank)
            devices = parallel.all_gather_objects(parallel.device_name(device), rank)
            rows = comm.summarize(per_rank, rank.world_size)
            runs.log_points(
                [(f"{r['primitive']}_{key}", r[key], r["bytes"]) for r in rows for key in ("algbw_gbps", "busbw_gbps")
                 if r[key] is not None],
                [(f"{t['primitive']}_time_us", t["seconds"] * 1e6, t["bytes"]) for t in mine["timings"]])
            failure = comm.failure_message(per_rank, backend)
            if rank.is_main:
                echo_detail(table(rows))
            if failure:
                # Every rank stops; rank 0 says why, once, as the CLI words an error, and before any
                # rank leaves: a rank gone is what the launcher acts on, and it would stop rank 0
                # before its message was out.
                if rank.is_main:
                    click.echo(f"Error: {failure}", err=True)
                parallel.all_gather_objects(None, rank)
                raise SystemExit(1)
            if rank.is_main:
                # The hardware the verdict holds for: another backend, rank count or device retrains.
                facts = {"world_size": rank.world_size, "backend": backend, "device": device.type,
                         "devices": devices}
                checked = comm.checkable(rank.world_size)
                summary = per_primitive(rows, checked, per_rank)
                write_json(RESULTS_FILE, {"enabled": True, "passed": True, **facts, "host": socket.gethostname(),
                                          "primitives": summary, "sweep": rows})
                write_json(VERDICT_FILE, {"enabled": True, "passed": True, **facts, "primitives": list(checked)})
                skipped = [p for p in comm.PRIMITIVES if p not in checked]
                sweep = config.commcheck
                largest = comm.sizes(sweep.min_bytes, sweep.max_bytes, sweep.factor)[-1]
                cut = {name: got["largest_bytes"] for name, got in summary.items()
                       if got.get("largest_bytes", largest) < largest}
                if cut:
                    echo_detail(f"commcheck: the sweep stopped short of max_bytes ({largest}) to stay within "
                               f"commcheck.budget_s = {sweep.budget_s:g} s; largest message: "
                               + ", ".join(f"{name} {size}" for name, size in cut.items()))
                click.echo(f"commcheck: all {len(checked)} primitives passed on {rank.world_size} ranks ({backend})"
                           + (f"; {', '.join(skipped)} need a second rank" if skipped else "")
                           + f"; timings in {RESULTS_FILE}" + ("" if verbose() else " (-v prints them)"))


@click.command(short_help="Check every torch.distributed primitive, timed.")
@params_option
def commcheck(params_path: str) -> None:
    """Check and time every torch.distributed primitive across the training devices."""
    config = load_config(params_path)
    if parallel.under_torchrun():
        run_worker(config)
    elif not config.commcheck.enabled:
        for path in (RESULTS_FILE, VERDICT_FILE):
            write_json(path, {"enabled": False})
        click.echo("commcheck: skipped (commcheck.enabled is false)")
    elif not any(parallel.distributed(mode) for mode in config.train.modes):
        write_json(RESULTS_FILE, {"enabled": False, "skipped": "neither ddp nor fsdp is in train.modes"})
        if not VERDICT_FILE.is_file():
            write_json(VERDICT_FILE, {"enabled": False})
        click.echo("commcheck: nothing to check (neither ddp nor fsdp is in train.modes, and no other mode uses "
                   "torch.distributed)")
    else:
        parallel.check_every_mode(config.train)
        workload_of(config.workload)  # its model sizes the all_reduce: a broken one is said here, not by every rank
        if config.tracking.enabled:
            check_store(tracking_uri())
        command = ["commcheck", "--params", params_path]
        if slurm.launcher(config) == "slurm":  # across the nodes training will use, not on this one
            slurm.submit(config, command, LOG_DIR, slurm.job_for(config, "commcheck"))
        else:
            launch_workers(config, command)
