"""train: data/prepared -> models/<mode>/, results/train/<mode>.json, plots/train/<mode>.csv (per epoch),
plots/steps/<mode>.csv (the training loss per window of steps), results/breakdown/<mode>.json (where
the steps' time went)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import os
import secrets
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import click
import torch

from pipeline import checkpoint, compiled, gpus, parallel, record, workloads
from pipeline.runtime import forkserver, lockfile
from pipeline.atomic import in_the_way, save_torch, writable_folder, write_json, write_text
from pipeline.checkpoint import CHECKPOINT_FILE, MODEL_FILE, resume_state, trajectory
from pipeline.shards import SHARDS_DIR
from pipeline.record import code_folders
from pipeline.unfinished import OUTPUTS_COMPLETE, UNFINISHED_FILE, unfinished
from pipeline.config import MODES, Config, flatten, load_config, read_config
from pipeline.determinism import use_deterministic_algorithms
from pipeline.precision import float32_means_float32
from pipeline.errors import ConfigError, PipelineError
from pipeline.batches import AUGMENTED_IN_MEMORY, split_of
from pipeline.loop import TRACE_DIR, Training, steps_per_epoch
from pipeline.loop import train as train_model
from pipeline.prepared import STATS_FILE, load_stats
from torch.utils.data import default_collate
from pipeline.tracking.delivery import OUTBOX_DIR
from pipeline.tracking.runs import fail_unfinished, missing_runs, start_mode_run, until_done
from pipeline.tracking.bucket import check_experiment, check_node_artifacts
from pipeline.tracking.store import check_worker_store, preflight, shown, tracking_uri
from pipeline.tracking import outbox
from stages.common import model_dir, params_option, read_run_ids, run_ids_file
from stages import slurm
from stages.workers import launch_workers, run_facts

log = logging.getLogger(__name__)
RESULTS_DIR = Path("results/train")
CURVES_DIR = Path("plots/train")
STEPS_DIR = Path("plots/steps")
BREAKDOWN_DIR = Path("results/breakdown")
RUN_FILES = "run-files"  # in models/<mode>: what the parent run gets besides the model and checkpoint
TIME_COLUMNS = ("samples_per_s", "train_time_s", "epoch_time_s")  # epoch_time_s: with the validation


def quality_keys(m: dict) -> list[str]:
    """An epoch's losses and the workload's metrics (MNIST: accuracy), as the loop names them."""
    scores = m.get("scores", ["accuracy"])  # a history from before workloads were named: MNIST's
    return ["train_loss", *(f"train_{s}" for s in scores), "val_loss", *(f"val_{s}" for s in scores)]


def untimed(config: Config, steps: int, history: list[dict]) -> dict[str, str | None]:
    """Why an epoch of `steps` steps gave no steady throughput, and why the last one had no
    measured step (None: it had them), naming the setting that took them."""
    train = config.train
    no_steady = (None if any(m.get("steady_samples_per_s") for m in history) else
                 f"each epoch's {steps} step(s) are all warm-up (train.throughput_warmup_steps: "
                 f"{train.throughput_warmup_steps})")
    if history[-1].get("breakdown"):
        unmeasured = None
    elif history[-1].get("resumed_at_step"):
        unmeasured = (f"the last epoch was resumed at its step {history[-1]['resumed_at_step']} from a mid-epoch "
                      "checkpoint (train.checkpoint_every_steps)")
    elif not train.breakdown_steps:
        unmeasured = "train.breakdown_steps is 0"
    else:  # the window gives way to the traced steps (pipeline.breakdown.Probe.start_epoch)
        unmeasured = (f"the last epoch's {steps} step(s) all went to train.trace_steps "
                      f"({train.trace_steps})")
    return {"no_steady": no_steady, "unmeasured": unmeasured}


def summarize(config: Config, mode: str, rank: parallel.Rank, device, history: list[dict], steps: int) -> dict:
    last = history[-1]
    train_time = sum(m["train_time_s"] for m in history)
    samples = sum(m["samples_per_s"] * m["train_time_s"] for m in history)
    steady = [m for m in history if m.get("steady_samples_per_s")]
    steady_time = sum(m["steady_time_s"] for m in steady)
    return {
        "mode": mode,
        "world_size": rank.world_size,
        "nodes": parallel.nodes(rank),
        "procs_per_node": rank.local_world_size,
        "backend": parallel.backend_for(device) if parallel.distributed(mode) else None,
        "device": device.type,
        "device_name": parallel.device_name(device),
        # The cores this process could use: on a CPU, what no speed-up can exceed (per node).
        "cpu_cores": parallel.available_cpus(),
        # DataParallel splits each batch over this many devices; 1 on a CPU-only host (bare module).
        "dp_devices": parallel.dp_device_count(device) if mode == "dp" else None,
        "epochs": len(history),
        "batch_size": config.train.batch_size,
        # Each rank's share of a global batch (ddp, fsdp), or each GPU's (dp): "43/43/42".
        "batch_shares": batch_shares_label(config.train.batch_size, mode, rank, device),
        "train_time_s": round(train_time, 3),
        "samples_per_s": round(samples / train_time, 1),
        # After each epoch's first `warmup_steps` steps; None if no epoch had more steps than that.
        "steady_samples_per_s": (round(sum(m["steady_samples_per_s"] * m["steady_time_s"] for m in steady)
                                       / steady_time, 1) if steady_time else None),
        "warmup_steps": config.train.throughput_warmup_steps,
        "steps_per_epoch": steps,
        # Why no figure after the warm-up, or no measured step, when there is none (else None).
        **untimed(config, steps, history),
        # The last epoch's mean step after the warm-up, slow ones included, beside its measured steps'
        # (pipeline.spread: far from theirs, the measured windows missed or caught a slow spell).
        "steady_step_s": (round(last["steady_time_s"] / last["steady_steps"], 6)
                          if last.get("steady_time_s") and last.get("steady_steps") else None),
        # What else the host ran during the last epoch (the one whose steps were measured).
        "host_load": last.get("host_load"),
        # The largest rank's parameters, gradients and optimizer state, in MiB (fsdp's: about 1/W of ddp's).
        "state_mb_per_rank": round(max(last["rank_state_mb"]), 4) if "rank_state_mb" in last else None,
        # On GPUs, the largest rank's allocator peak in the last epoch (torch.cuda.max_memory_allocated).
        "peak_memory_mb_per_rank": (round(max(last["rank_peak_memory_mb"]), 1)
                                    if "rank_peak_memory_mb" in last else None),
        **{key: last[key] for key in quality_keys(last)},
    }


def breakdown_summary(config: Config, mode: str, rank: parallel.Rank, device, history: list[dict],
                      steps: int) -> dict:
    """Where the last epoch's steps went, rank by rank (pipeline.breakdown), with what compare's
    scaling model needs to know about the run; `ranks` is empty with train.breakdown_steps: 0."""
    ranks = history[-1].get("breakdown") or []
    return {"mode": mode, "world_size": rank.world_size, "nodes": parallel.nodes(rank), "device": device.type,
            "device_name": parallel.device_name(device), "batch_size": config.train.batch_size,
            "dp_devices": parallel.dp_device_count(device) if mode == "dp" else None,
            "batch_shares": batch_shares_label(config.train.batch_size, mode, rank, device),
            "ranks": [{"rank": r, **b} for r, b in enumerate(ranks) if b],
            "unmeasured": untimed(config, steps, history)["unmeasured"],
            "link": measured_link(rank, device) if parallel.distributed(mode) else None}


def measured_link(rank: parallel.Rank, device) -> dict | None:
    """commcheck's all_reduce sweep, when it measured this training's world: the link the scaling
    model computes DDP's communication on (read here, not by compare, so a commcheck that runs
    on every `dvc repro` does not make compare run again)."""
    comm = Path("results/comm.json")
    try:
        facts = json.loads(comm.read_text())
    except (OSError, ValueError):
        return None
    if not facts.get("passed") or facts.get("world_size") != rank.world_size or facts.get("device") != device.type \
            or facts.get("backend") != parallel.backend_for(device):
        return None  # measured on other devices, or another world: not this training's link
    return {"world_size": facts["world_size"], "backend": facts.get("backend"),
            "sweep": [r for r in facts.get("sweep", []) if r["primitive"] == "all_reduce"]}


def batch_shares_label(global_batch: int, mode: str, rank: parallel.Rank, device) -> str:
    if parallel.distributed(mode):
        return parallel.shares_label(parallel.batch_shares(global_batch, rank.world_size))
    if mode == "dp":
        return parallel.shares_label(parallel.dp_shares(global_batch, parallel.dp_device_count(device)))
    return str(global_batch)


def csv_text(rows: list[dict], columns: tuple[str, ...]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def step_rows(history: list[dict]) -> list[dict]:
    """The training loss per window of steps, every epoch's (loop.loss_windows)."""
    return [{"step": int(step), "epoch": m["epoch"], "train_loss": loss}
            for m in history for step, loss in m.get("loss_windows", ())]


def attach_rank_log(path: Path) -> Path:
    """Every record of this rank, at INFO and above, also goes to its own file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return path


def run_worker(config: Config, params_text: str, mode: str, data_dir: Path, resume: bool) -> None:
    """Train in this process: the whole job for single and dp, one rank's share for ddp and fsdp.
    `params_text`: the params file as `config` was read from it."""
    rank = parallel.rank_from_env()
    if not rank.is_main:
        for handler in logging.getLogger().handlers:  # other ranks speak only when something fails
            handler.setLevel(logging.WARNING)
    out = model_dir(mode)
    rank_log = attach_rank_log(out / "logs" / f"rank-{rank.rank}.log")
    use_deterministic_algorithms(config.train.deterministic)  # before any CUDA work
    if not config.train.bf16:
        float32_means_float32()
    device = parallel.pick_device(rank, config.train.device, every_gpu=mode == "dp")
    if parallel.distributed(mode) and device.type == "cpu":
        parallel.limit_cpu_threads(rank)
    if config.tracking.enabled:
        check_worker_store(rank)
        check_node_artifacts(rank, config.tracking)

    with parallel.process_group(rank, device) if parallel.distributed(mode) else nullcontext():
        workload = workloads.load_workload(config.workload)  # checked at the start (check_can_start)
        stats = load_stats(data_dir)
        channels_last = device.type == "cuda" and config.train.channels_last
        train_split, val_split = (
            split_of(workload.split(data_dir, name), device, config.train.loader, config.train.loader_workers,
                     channels_last, seed=config.train.seed if name == "train" else None) for name in ("train", "val"))
        log.info("%s: %d process(es) on %s, global batch %d", mode, rank.world_size,
                 parallel.device_name(device), config.train.batch_size)
        if config.train.loader == "dataloader":
            log.info("%s: samples read from %s by DataLoaders, %d worker process(es) each for training and "
                     "for validation, a rank", mode, data_dir, config.train.loader_workers)
        if config.train.fp16:
            log.info("%s: fp16 autocast with a loss scaler (train.fp16, in place of train.bf16)", mode)
        if config.train.compile:
            log.info("%s: torch.compile (train.compile): the first step compiles the model", mode)

        params = {**flatten(config), "world_size": rank.world_size,
                  "batch_shares": batch_shares_label(config.train.batch_size, mode, rank, device)}
        # Read once, on rank 0, and sent to all: the loop continues from it, tracking reopens the runs it names.
        state = resume_state(out / CHECKPOINT_FILE, trajectory(config.train, mode, config.workload), asked=resume,
                             restarted=parallel.restarted(), rank=rank, launch=parallel.launch_id())
        facts = {**run_facts(mode, rank, device, distributed=parallel.distributed(mode)), **record.inputs(params, data_dir)}
        tracking = config.tracking
        if os.environ.get(record.REPRODUCES_ENV):  # a reproduction: said from the start, and nothing registered
            facts["reproduces"] = os.environ[record.REPRODUCES_ENV]
            tracking = dataclasses.replace(tracking, registered_model="")
        if state is None and not parallel.restarted():
            # A fresh training (under any launcher): what an earlier one left unsent is not its to replay.
            dropped = outbox.discard(out / OUTBOX_DIR, f"rank-{rank.rank}")
            if dropped:
                log.warning("%s: rank %d dropped %d tracking calls an earlier training kept for its own runs",
                            mode, rank.rank, dropped)
        runs = start_mode_run(tracking, mode, rank, facts, params,
                              state.get("extra", {}).get("mlflow") if state else None,
                              outbox_dir=out / OUTBOX_DIR, workload=config.workload.class_path)
        with until_done(runs):  # from the moment the runs exist: nothing may leave them RUNNING
            if rank.is_main:  # at once, so the launcher can end these runs if a worker is killed outright
                write_json(run_ids_file(mode), runs.ids)
            if state is None:  # a resumed run has them already
                runs.log_datasets(data_dir, ("train", "val"))
            run = Training(config.train, mode, rank, device, out, resume_state=state, epoch_hooks=[runs.log_epoch],
                           extra_state={"mlflow": runs.ids, "launch": parallel.launch_id()},
                           log_every_n_steps=config.tracking.log_every_n_steps, workload=config.workload)
            try:
                model, history = train_model(run, train_split, val_split)
            finally:  # a DataLoader's workers (train.loader: dataloader) end with the training
                train_split.close()
                val_split.close()
            # Before the runs end FINISHED: a module imported late ran the bytes saved meanwhile.
            record.check_code_as_imported()
            if rank.is_main:
                inputs_unchanged(mode, data_dir, required=False)
                write_outputs(config, params_text, mode, rank, device, model, history, data_dir, stats,
                              len(train_split), runs, workload)
            trace = out / TRACE_DIR / f"trace-rank-{rank.rank}.json"  # opens in Perfetto (ui.perfetto.dev)
            runs.log_rank_artifacts([rank_log, *([trace] if trace.is_file() else [])])


def write_outputs(config: Config, params_text: str, mode: str, rank: parallel.Rank, device: torch.device,
                  model: torch.nn.Module, history: list[dict], data_dir: Path, stats: dict, train_count: int,
                  runs, workload: workloads.Workload) -> None:
    out = model_dir(mode)
    curves = CURVES_DIR / f"{mode}.csv"
    save_torch(out / MODEL_FILE, {
        "state_dict": model.state_dict(),
        "workload": workloads.recorded(config.workload),  # what builds the network these weights fit
        # MNIST's: what its inputs were normalised with (a reader of the file outside the pipeline).
        **({"normalization": {"mean": stats["train_pixel_mean"], "std": stats["train_pixel_std"]}}
           if "train_pixel_mean" in stats else {}),
        "config": flatten(config),
    })
    steps = steps_per_epoch(train_count, config.train.batch_size)
    write_json(RESULTS_DIR / f"{mode}.json", summarize(config, mode, rank, device, history, steps))
    write_text(curves, csv_text(history, ("epoch", *quality_keys(history[-1]), *TIME_COLUMNS)))
    write_text(STEPS_DIR / f"{mode}.csv", csv_text(step_rows(history), ("step", "epoch", "train_loss")))
    write_json(BREAKDOWN_DIR / f"{mode}.json", breakdown_summary(config, mode, rank, device, history, steps))
    write_json(run_ids_file(mode), runs.ids)
    # The run's files are uploaded from the mode's own folder only (delivery.op_checker): copies.
    run_files = out / RUN_FILES
    write_text(run_files / "params.yaml", params_text)  # as read at the start, not as the file is now
    write_text(run_files / curves.name, curves.read_text())
    example = example_inputs(workload.split(data_dir, "val"))
    # Every output is in place: said in the record, with the run the model goes to, so that what
    # comes next knows the training is done whatever happens to its runs' end (an outage keeps that
    # for send-runs, which then removes the record). A `dvc repro` before that goes on in the same
    # run and writes these files again (DVC deleted them); its model went there the first time.
    record = unfinished(out)
    parent = runs.ids.get("parent", "")
    if record is not None:
        write_json(out / UNFINISHED_FILE, {**record, OUTPUTS_COMPLETE: parent})
    if (record or {}).get(OUTPUTS_COMPLETE, None) != parent or not parent:
        runs.finish_parent(out / MODEL_FILE, example,
                           [out / CHECKPOINT_FILE, run_files / curves.name, run_files / "params.yaml"],
                           workload=config.workload.class_path)


def example_inputs(samples: workloads.Samples, count: int = 4) -> torch.Tensor:
    """The split's first inputs as the model takes them: the logged model's input example."""
    inputs = default_collate([samples.dataset[i] for i in range(min(count, len(samples.dataset)))])[0]
    return samples.on_device(inputs) if samples.on_device is not None else inputs


def planned_world_size(config: Config, mode: str) -> int | None:
    """The ranks this training will have; None where a Slurm job decides (train.nproc 0)."""
    if not parallel.distributed(mode):
        return 1
    if config.train.launcher == "slurm" and not config.train.nproc:
        return None
    workers, nodes = parallel.ddp_layout(config.train)
    return workers * nodes


def pick_up(config: Config, mode: str, data_dir: Path, asked: bool) -> bool:
    """Whether this training continues an interrupted one in models/<mode> (dvc.yaml keeps that
    folder between attempts). It does when the settings, the prepared data, the code and the
    tracking store are as they were, so it ends where an uninterrupted training would, in the same
    MLflow runs. One that cannot go on leaves no RUNNING run behind, and no checkpoint or outbox
    to be taken for this one's."""
    out = model_dir(mode)
    inputs = checkpoint.inputs_snapshot(data_dir, code_folders())
    settings = stage_settings(config)
    record = unfinished(out)
    if asked and record is not None and "inputs" in record:
        changed = checkpoint.inputs_changed(record["inputs"], inputs)
        if changed:  # the later epochs would run other code (or data) than the runs' record names
            raise PipelineError(f"{out}: {changed} since this training started, so --resume would finish it "
                                "with other code or data than its record names: put it back, or train afresh "
                                "without --resume")
    kept = outbox.unsent(out / OUTBOX_DIR)
    if asked and (out / CHECKPOINT_FILE).is_file():  # ours, and of these settings: said before anything changes
        state = checkpoint.load_checkpoint(out / CHECKPOINT_FILE, trajectory(config.train, mode, config.workload))
        refused = checkpoint.other_world(state, planned_world_size(config, mode), out / CHECKPOINT_FILE)
        if refused:
            raise PipelineError(refused)
        train_count = load_stats(data_dir).get("splits", {}).get("train", {}).get("count")
        if train_count:  # check_prepared has refused a stats.json without it
            checkpoint.check_schedule_length(state, config.train.epochs * steps_per_epoch(
                train_count, config.train.batch_size), out / CHECKPOINT_FILE)
    go_on = asked  # --resume: continue whatever is there (the workers check it again, on every node's disk)
    missing = missing_runs(config.tracking, read_run_ids(mode)) if (record is not None or asked or kept) else []
    if record is None and kept and not asked and not missing:  # a fresh start would drop what can still be sent
        raise PipelineError(
            f"{out / OUTBOX_DIR}: {kept} tracking calls of the last training (finished, its outputs saved) "
            f"were never sent: send them with `mnist-pipeline send-runs --mode {mode}` once the tracking store "
            f"answers (or drop them with `mnist-pipeline send-runs --mode {mode} --discard`), then run again")
    if asked and missing and (out / CHECKPOINT_FILE).is_file():
        raise PipelineError(
            f"{out / CHECKPOINT_FILE} continues MLflow runs that the tracking store "
            f"{shown(tracking_uri())} does not hold ({missing[0]}...): set MLFLOW_TRACKING_URI "
            "back to the store it was trained with, or train afresh without --resume")
    if record is not None and not asked:
        why_not = checkpoint.why_not_continue(out, record, trajectory(config.train, mode, config.workload), inputs, settings,
                                              planned_world_size(config, mode))
        if why_not is None and missing:
            why_not = (f"its MLflow runs are not in (or were deleted from) the tracking store "
                       f"{shown(tracking_uri())} (was MLFLOW_TRACKING_URI changed?)")
        go_on = why_not is None
        if go_on:
            log.info("%s: continuing the training interrupted in %s", mode, out)
        else:
            log.warning("%s: the training interrupted in %s cannot go on: %s; starting afresh, its MLflow "
                        "runs end FAILED", mode, out, why_not)
            if not missing:
                fail_unfinished(config.tracking, read_run_ids(mode))
    if not go_on:  # what an earlier training left there (its logs are in MLflow and DVC's cache)
        (out / CHECKPOINT_FILE).unlink(missing_ok=True)
        for folder in ("logs", TRACE_DIR, SHARDS_DIR):
            shutil.rmtree(out / folder, ignore_errors=True)
        dropped = outbox.discard(out / OUTBOX_DIR)
        if dropped:  # said, not silent: they were an earlier training's, for runs now ended
            log.warning("%s: dropped %d tracking calls an earlier training kept in %s for its own runs, which "
                        "were never sent", mode, dropped, out / OUTBOX_DIR)
    # Going on from a training whose outputs were complete: it still was (write_outputs logs no model again).
    complete = {OUTPUTS_COMPLETE: record[OUTPUTS_COMPLETE]} if go_on and OUTPUTS_COMPLETE in (record or {}) else {}
    write_json(out / UNFINISHED_FILE, {"inputs": inputs, "settings": settings,
                                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                       "snapshot": os.environ[forkserver.SNAPSHOT_ENV], **complete})
    return go_on


# Params of train@<mode> that no output depends on: how long to wait for a server, how often to sample.
OPERATIONAL = ("train.modes", "tracking.outage_wait_s", "tracking.system_metrics_interval_s")


def stage_settings(config: Config) -> dict:
    """Every setting a training's outputs depend on: the params dvc.yaml gives train@<mode>, which
    are the workload's, train's and tracking's (but OPERATIONAL), as they read back from JSON."""
    return json.loads(json.dumps({key: value for key, value in flatten(config).items()
                                  if key.startswith(("workload.", "train.", "tracking.")) and key not in OPERATIONAL}))


def check_can_start(config: Config, mode: str, data_dir: Path) -> None:
    """Everything that can be checked before the disk changes: a training that cannot start must
    leave the last one's checkpoint, logs and runs as they were (pick_up changes them)."""
    check_output_folders(mode)
    # The workload imports, builds, and gives the right kinds of things on its example batch.
    workload = workloads.workload_of(config.workload)
    # A file saved since this command's imports: refused before pick_up clears the last training's files.
    record.check_code_as_imported()
    if config.tracking.enabled:
        check_experiment(preflight(config.tracking))  # store, schema, host, account, experiment, bucket
    if slurm.launcher(config) == "slurm":  # every mode trains in a job, on a node like DDP's
        slurm.check_ready(config, slurm.job_for(config, "train", mode))
    else:
        gpus.gpus_as_wanted(config.train.device)  # train.device: cuda without a GPU fails here
    parallel.check_every_mode(config.train, mode)
    if config.train.compile and slurm.launcher(config) == "local":  # a Slurm node checks its own
        on_gpus = gpus.gpus_as_wanted(config.train.device)
        compiled.check_can_compile("cuda" if on_gpus else "cpu", mode, gpus.cuda_device_count() if on_gpus else 1)
    if parallel.distributed(mode):
        # Fail here, before any worker starts, on what would fail in every worker.
        workers, nodes = parallel.ddp_layout(config.train)
        if slurm.launcher(config) == "local" and not parallel.under_torchrun():
            forkserver.check_socket_path()
        if config.tracking.enabled:  # a store on one node's disk cannot take ranks from several
            check_worker_store(parallel.Rank(world_size=workers * nodes, local_world_size=workers))
    check_prepared(data_dir, config.train.batch_size, workload, config.workload.class_path, config.train.loader)


def check_prepared(data_dir: Path, batch_size: int, workload: workloads.Workload | None = None,
                   class_path: str | None = None, loader: str = "memory") -> None:
    """The prepared data is there, is what the workload's `prepare` wrote (its `split` checks), and
    its samples go through the workload's model; a training split that is augmented is read by a
    DataLoader (`loader`); a split too small for one batch is allowed (quick runs) but said, with
    its numbers."""
    workload = workload or workloads.default_workload()
    where = f"workload {class_path or workloads.WorkloadConfig().class_path}"
    described = load_stats(data_dir).get("splits", {})
    counts, model = {}, workload.build_model().eval()
    for name in ("train", "val"):
        samples = workload.split(data_dir, name)
        counts[name] = len(samples.dataset)
        if name == "train" and samples.augment is not None and loader == "memory":
            raise ConfigError(f"{where}: {AUGMENTED_IN_MEMORY}")
        if not counts[name] or counts[name] != described.get(name, {}).get("count"):
            raise PipelineError(f"{data_dir}: the {name} split of {where} has {counts[name]} samples, and "
                                f"{STATS_FILE} says {described.get(name, {}).get('count')}; run `mnist-pipeline "
                                "prepare` (or `dvc repro prepare`) again")
        try:  # what example_batch() cannot show: the data and the model disagree (its shape, its kind)
            inputs = example_inputs(samples, count=2)
            with torch.no_grad():
                model(inputs)
        except Exception as exc:
            raise PipelineError(f"{data_dir}: the model of {where} fails on the first samples of its {name} split "
                                f"({type(exc).__name__}: {exc}); make prepare write what the model takes "
                                "(then `dvc repro prepare`), or change the model") from None
    if counts["train"] < batch_size:
        log.warning("the training split has %d samples (validation %d), fewer than one global batch "
                    "(train.batch_size = %d): every epoch is a single step of %d samples",
                    counts["train"], counts["val"], batch_size, counts["train"])


@click.command(short_help="Train one mode: single, dp, ddp or fsdp.")
@params_option
@click.option("--mode", type=click.Choice(MODES), help="single, dp (DataParallel), ddp or fsdp (FSDP2's fully_shard).")
@click.option("--mode-of-dvc-stage", "from_stage", is_flag=True,
              help="The mode named by the DVC stage running this (DVC_STAGE=train@<mode>), as dvc.yaml says.")
@click.option("--data-dir", default="data/prepared", show_default=True, type=click.Path(file_okay=False))
@click.option("--resume", is_flag=True, help="Continue from models/<mode>/checkpoint.pt.")
def train(params_path: str, mode: str | None, from_stage: bool, data_dir: str, resume: bool) -> None:
    """Train one mode. For ddp and fsdp, starts one worker per device unless already under torchrun; with
    train.launcher: slurm, every mode trains in a Slurm job."""
    mode = stage_mode() if from_stage else mode
    if mode is None:
        raise click.UsageError("say which mode to train: --mode single, dp, ddp or fsdp")
    config, params_text = read_config(params_path)  # the text: what the run records, checked at the end
    if parallel.under_torchrun() or slurm.submitted_job():  # a worker, or the job: its launcher or submitter decided
        if parallel.rank_from_env().is_main:
            check_output_folders(mode)
        run_worker(config, params_text, mode, Path(data_dir), resume)
        return
    check_output_folders(mode)  # the lock lives in models/<mode>
    with lockfile.held(model_dir(mode), f"train --mode {mode}"):
        check_can_start(config, mode, Path(data_dir))
        # Names this training's record for its workers, who inherit it (stages.cli sets it before the
        # DDP fork server starts): a record they find without it is another training's, left where
        # an outer launcher (torchrun, a scheduler) runs them.
        os.environ.setdefault(forkserver.SNAPSHOT_ENV, secrets.token_hex(8))
        resume = pick_up(config, mode, Path(data_dir), asked=resume)
        if parallel.distributed(mode) or slurm.launcher(config) == "slurm":
            launch(config, mode, params_path, data_dir, resume)
            # Rank 0 checked before its runs ended, maybe on another node's disk: this one's, once more.
            inputs_unchanged(mode, Path(data_dir))
        else:
            run_worker(config, params_text, mode, Path(data_dir), resume)  # which checked before its runs ended
        params_unchanged(Path(params_path), params_text, config)  # else DVC would record what did not train
        (model_dir(mode) / UNFINISHED_FILE).unlink()  # only now: every output is in place, every run ended


def params_unchanged(path: Path, text: str, config: Config) -> None:
    """The params file still says what this training read at its start. DVC records the params it
    finds after the stage, so an edit saved during the training would put settings into dvc.lock
    that never trained: the stage fails instead, and DVC records nothing."""
    try:
        now = path.read_text()
    except OSError:
        now = None
    if now == text:
        return
    try:
        new, old = flatten(load_config(path)), flatten(config)
        keys = [key for key in old if new.get(key) != old[key]]
        changed = ", ".join(f"{key}: {old[key]!r} -> {new.get(key)!r}" for key in keys[:4]) or "its text only"
    except PipelineError as exc:
        changed = f"now unreadable: {exc}"
    raise PipelineError(f"{path} changed while this training ran ({changed}): the outputs are of the settings it "
                        "read at its start, so DVC records nothing; run it again to train with the new settings")


def inputs_unchanged(mode: str, data_dir: Path, required: bool = True) -> None:
    """The code and the prepared data are still what this training read at its start (pick_up's
    snapshot): DVC hashes a stage's dependencies after it runs, so a file saved meanwhile would go
    into dvc.lock beside a model it never trained. The stage fails instead, and DVC records nothing.
    Rank 0 checks it before its runs end (`required`: False, and only against its own launcher's
    snapshot, not one an outer launcher left); a launcher of other processes again once they are done."""
    record = unfinished(model_dir(mode)) or {}
    if not required and (record.get("snapshot") is None or record.get("snapshot") != os.environ.get(forkserver.SNAPSHOT_ENV)):
        return
    then = record.get("inputs")
    changed = checkpoint.inputs_changed(then, checkpoint.inputs_snapshot(data_dir, code_folders()))
    if changed:
        raise PipelineError(f"{changed} while this training ran: its outputs are of the code and data it read at "
                            "its start, so DVC records nothing; run it again")


def stage_mode() -> str:
    """The mode of the DVC stage running this command: dvc.yaml passes it this way, not as
    `--mode ${item}`, which would put params.yaml's text (train.modes) into a shell command."""
    stage = os.environ.get("DVC_STAGE", "").rpartition(":")[2]  # run from a subfolder: ../dvc.yaml:train@dp
    mode = stage.partition("@")[2]
    if not stage.startswith("train@") or mode not in MODES:
        raise PipelineError(f"DVC_STAGE={stage!r}: --mode-of-dvc-stage needs a stage train@<mode>, one of {MODES}; "
                            "check train.modes in params.yaml")
    return mode


def check_output_folders(mode: str) -> None:
    """Before any work, and before anything an earlier training left is removed: training is lost
    if it cannot be saved."""
    for folder in (model_dir(mode), RESULTS_DIR, CURVES_DIR, STEPS_DIR, BREAKDOWN_DIR):
        writable_folder(folder)
    for folder in ("logs", TRACE_DIR, RUN_FILES, OUTBOX_DIR):  # made later, by the training
        in_the_way(model_dir(mode) / folder)


def launch(config: Config, mode: str, params_path: str, data_dir: str, resume: bool) -> None:
    """Train in other processes: DDP's workers here, or a Slurm job (DDP's over train.nodes nodes,
    single's and dp's on one)."""
    command = (["train", "--mode", mode, "--params", params_path, "--data-dir", data_dir]
               + (["--resume"] if resume else []))
    try:
        if slurm.launcher(config) == "slurm":
            slurm.submit(config, command, model_dir(mode) / "logs", slurm.job_for(config, "train", mode))
            if not (model_dir(mode) / MODEL_FILE).is_file():
                raise PipelineError(
                    f"the Slurm job ended, but {model_dir(mode) / MODEL_FILE} is not here: if the job wrote it, "
                    "it was on its node's own disk. Submit from a directory every node shares")
        else:
            launch_workers(config, command)
    except BaseException:
        # A process killed outright (SIGKILL, out of memory) could not end its own run: the
        # launcher ends every run of this training that is still RUNNING.
        fail_unfinished(config.tracking, read_run_ids(mode))
        raise
