"""A training's runs, seen from one rank: the mode's parent run (rank 0's) and a child run per
rank, made or found again, logged to through the outbox, and ended FINISHED or FAILED whatever
happens; and the checks a training makes of them before it starts."""

from __future__ import annotations

import logging
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from pipeline.config import MODES, TrackingConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.runtime.lifecycle import stop_signals_unwind
from pipeline.tracking.delivery import outbox_for, stamped
from pipeline.tracking.facts import dvc_experiment_facts, git_facts, log_datasets, log_uncommitted_change, run_name
from pipeline.tracking.store import open_experiment, reason, run_deleted, shown, store_errors, tracking_uri

if TYPE_CHECKING:  # pipeline.parallel imports torch, which compare and send-runs never need
    from pipeline.parallel import Rank

log = logging.getLogger(__name__)
PARENT_TAG = "mlflow.parentRunId"
FAILED_DRAIN_S = 10  # after a failure, how long ending the runs may wait on the server


def missing_runs(config: TrackingConfig, ids: dict) -> list[str]:
    """The runs of `ids` (a training's, from mlflow_run.json) that the current store does not
    hold, or holds deleted (in the UI, or by `mlflow gc`'s first step): a training whose store
    changed cannot continue in them."""
    if not config.enabled or not ids:
        return []
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client, missing = MlflowClient(tracking_uri()), []
    for run_id in [ids["parent"], *ids.get("children", {}).values()]:
        try:
            if client.get_run(run_id).info.lifecycle_stage == "deleted":
                missing.append(run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            missing.append(run_id)
    return missing


def metric_batch(points: Iterable[tuple[str, float, int]]) -> list:
    """(key, value, step) triples as MLflow metrics, all stamped now."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(key, float(value), now, step) for key, value, step in points]


def numeric(values: dict[str, Any], step: int) -> list[tuple[str, float, int]]:
    """The numeric entries of `values` at `step` (lists, like per-rank checksums, are not metrics)."""
    return [(k, v, step) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _as_params(flat: dict[str, Any]) -> list:
    from mlflow.entities import Param

    return [Param(key, str(value)) for key, value in flat.items()]


@dataclass
class ModeRun:
    """One training's runs, seen from one rank: the parent (logged by rank 0) and this rank's child.
    Everything logged after the runs are made goes through `outbox`, so training never waits on
    the tracking server."""

    config: TrackingConfig
    mode: str
    rank: Rank
    uri: str
    experiment_id: str
    parent_id: str
    child_id: str
    children: dict[int, str]
    outbox: Any
    monitor: Any = None
    _client: Any = field(default=None, repr=False)
    reopen: bool = False  # a continued training: its ended runs are set RUNNING again by until_done

    def _end_now(self, status: str) -> None:
        """This rank's runs ended directly, not through the outbox (best effort: the store that
        refused one call may take this one)."""
        for run_id in [self.child_id] + ([self.parent_id] if self.rank.is_main else []):
            try:
                self._client.set_terminated(run_id, status)
            except Exception as exc:
                log.warning("could not mark MLflow run %s %s: %s", run_id, status, reason(exc))

    def start(self) -> None:
        """Inside the section that ends the runs: a continued training's runs go back to RUNNING
        only where a failure would end them again."""
        if self.reopen:
            with store_errors(self.uri, "reopening the runs"):
                if self.rank.is_main:
                    self._client.update_run(self.parent_id, status="RUNNING")
                self._client.update_run(self.child_id, status="RUNNING")

    @property
    def ids(self) -> dict[str, Any]:
        """What a resumed training needs to continue these same runs."""
        return {"experiment_id": self.experiment_id, "parent": self.parent_id, "children": self.children}

    def log_epoch(self, metrics: dict, rank_metrics: dict) -> None:
        """The training loop's epoch hook: one batch per run per epoch."""
        step = metrics["epoch"]
        parent = numeric({k: v for k, v in metrics.items() if k != "epoch"}, step)  # the step says it
        # The loss curve within the epoch, at the training step each window ends on.
        parent += [("train_loss_window", loss, int(at)) for at, loss in metrics.get("loss_windows", ())]
        own = numeric(rank_metrics, step) + [("step_loss", v, s) for s, v in rank_metrics.get("step_losses", ())]
        self.log_points(parent, own)

    def log_points(self, parent_points: Iterable[tuple[str, float, int]],
                   rank_points: Iterable[tuple[str, float, int]]) -> None:
        """(key, value, step) series in one batch per run: the parent's from rank 0, and this rank's."""
        if self.rank.is_main:
            self.outbox.put({"op": "metrics", "run": self.parent_id, "points": stamped(parent_points)})
        self.outbox.put({"op": "metrics", "run": self.child_id, "points": stamped(rank_points)})

    def log_datasets(self, data_dir: Path, splits: Iterable[str]) -> None:
        """Rank 0: the splits training read, on the parent run (at the start, with the runs)."""
        if self.rank.is_main:
            log_datasets(self._client, self.parent_id, data_dir, splits)

    def log_rank_artifacts(self, paths: Iterable[Path]) -> None:
        for path in paths:
            self.outbox.put({"op": "artifact", "run": self.child_id, "path": str(path)})

    def finish_parent(self, model_file: Path, example, artifacts: Iterable[Path], workload: str | None = None) -> None:
        """Rank 0: the mode's files and its model (read back from `model_file`, built by `workload`, the
        class path params.yaml names, with signature and `example` as input example) on the parent run."""
        for path in artifacts:
            self.outbox.put({"op": "artifact", "run": self.parent_id, "path": str(path)})
        self.outbox.put({"op": "model", "run": self.parent_id, "file": str(model_file), "mode": self.mode,
                         "example": example.tolist(), "example_dtype": str(example.dtype).removeprefix("torch."),
                         "registered": self.config.registered_model or None,
                         "workload": workload})

    def end(self, status: str, wait_s: float | None = None) -> None:
        """End this rank's child and, on rank 0, the parent: FINISHED, or FAILED on any error. Waits
        up to `wait_s` (tracking.outage_wait_s) for the server to take everything; if it does not,
        what is left stays in the outbox and this says how to send it."""
        if self.monitor is not None:
            try:
                self.monitor.finish()
                # A run shorter than one sampling interval would otherwise end with no system metrics.
                leftover = self.monitor.aggregate_metrics()
                if leftover:
                    self.monitor.publish_metrics(leftover)
                    self.monitor.mlflow_logger.flush()
            except Exception as exc:  # MLflow's own sampler: what it could not send is not kept
                log.warning("system metrics not sent: %s", exc)
        self.outbox.put({"op": "end", "run": self.child_id, "status": status})
        if self.rank.is_main:
            self.outbox.put({"op": "end", "run": self.parent_id, "status": status})
        wait_s = self.config.outage_wait_s if wait_s is None else wait_s
        left = self.outbox.drain(wait_s)
        self.outbox.close()
        refusal = getattr(self.outbox, "refusal", None)
        if left and refusal is not None:
            self._end_now("FAILED")  # the end calls wait behind the refused one: no run may stay RUNNING
            if run_deleted(refusal):
                raise PipelineError(
                    f"{self.mode}: a run of this training was deleted in the tracking store {shown(self.uri)} while it "
                    f"trained ({reason(refusal)}). Training's outputs are saved; what rank {self.rank.rank} could not "
                    f"send ({left} calls) is kept in {self.outbox.path}, for runs that are gone: drop it with "
                    f"`mnist-pipeline send-runs --mode {self.mode} --discard`, or restore the runs in the UI and "
                    f"`mnist-pipeline send-runs --mode {self.mode}`; a new training makes new runs")
            if isinstance(refusal, ConfigError):  # not the store's answer: the model itself (tracking.model)
                raise PipelineError(
                    f"{self.mode}: its MLflow model could not be logged ({refusal}). Training's outputs are saved; "
                    f"what rank {self.rank.rank} could not send ({left} calls) is kept in {self.outbox.path}: fix the "
                    f"workload, then `mnist-pipeline send-runs --mode {self.mode}`")
            raise PipelineError(
                f"{self.mode}: the tracking store {shown(self.uri)} refused this training's tracking "
                f"({reason(refusal)}). Training's outputs are saved; what rank {self.rank.rank} could not send "
                f"({left} calls) is kept in {self.outbox.path}. Fix what the store says (permissions, space, the "
                f"account), then `mnist-pipeline send-runs --mode {self.mode}`")
        if left:
            error = getattr(self.outbox, "last_error", None)
            if getattr(self.outbox, "disk_error", None) is not None:
                raise PipelineError(
                    f"{self.mode}: the tracking server {shown(self.uri)} did not take this training's tracking within "
                    f"tracking.outage_wait_s = {wait_s:g} s ({error}), and {left} calls could not be kept on disk "
                    f"either ({self.outbox.disk_error}): they are lost. Training's outputs are saved")
            raise PipelineError(
                f"{self.mode}: the tracking server {shown(self.uri)} did not take this training's tracking within "
                f"tracking.outage_wait_s = {wait_s:g} s ({error}). Training's outputs are saved; what rank "
                f"{self.rank.rank} could not send ({left} calls: metrics, files, the model, the runs' end) is kept "
                f"in {self.outbox.path}. When the server answers: `mnist-pipeline send-runs --mode {self.mode}`"
                + (f", then `dvc commit train@{self.mode}` to record the outputs" if self.mode in MODES else ""))


def start_mode_run(config: TrackingConfig, mode: str, rank: Rank, tags: dict[str, str], params: dict[str, Any],
                   resume: dict | None = None, outbox_dir: Path | None = None,
                   workload: str | None = None) -> ModeRun | Untracked:
    """Open (or, on resume, find again) the parent run on rank 0 and a child run on every rank. What is
    logged afterwards is kept in `outbox_dir` until the server has it (None: sent at once). `workload`:
    the class path params.yaml names, the one a model logged from the outbox may be built by."""
    if not config.enabled:
        return Untracked()
    from mlflow import MlflowClient

    from pipeline.parallel import all_gather_objects, broadcast_object, nodes

    uri = tracking_uri()
    made: list[str] = []  # runs this rank created: ended FAILED if the rest of the start fails
    client = None
    try:
        if rank.is_main:
            # Rank 0 alone touches the store first, so a new SQLite file is created (and its schema
            # migrated) by one process; the others connect after the broadcast below.
            client = MlflowClient(uri)
            if resume:
                experiment_id, parent_id = resume["experiment_id"], resume["parent"]
            else:
                with store_errors(uri, "starting the runs"):
                    experiment_id = open_experiment(client, config.experiment, uri)
                    run_tags = {**tags, **git_facts(), **dvc_experiment_facts(), "host": socket.gethostname()}
                    parent_id = client.create_run(experiment_id, run_name=run_name(mode), tags=run_tags).info.run_id
                    made.append(parent_id)
                    client.log_batch(parent_id, params=_as_params(params))
                    log_uncommitted_change(client, parent_id)
            shared = (experiment_id, parent_id)
        else:
            shared = None
        experiment_id, parent_id = broadcast_object(shared, rank)
        if client is None:
            client = MlflowClient(uri)

        previous = (resume or {}).get("children", {})
        if rank.rank in previous:
            child_id = previous[rank.rank]  # reopened by until_done, which also ends it
        else:
            child_tags = {**tags, **git_facts(), PARENT_TAG: parent_id, "mode": mode, "rank": str(rank.rank),
                          "local_rank": str(rank.local_rank), "world_size": str(rank.world_size),
                          "host": socket.gethostname(), **dvc_experiment_facts()}
            with store_errors(uri, "starting this rank's run"):
                child_id = client.create_run(experiment_id, run_name=run_name(f"{mode}/rank-{rank.rank}"),
                                             tags=child_tags).info.run_id
            made.append(child_id)
        children = dict(enumerate(all_gather_objects(child_id, rank)))
        outbox = outbox_for(outbox_dir, rank, uri, run_ids=[parent_id, *children.values()],
                            registered=config.registered_model, workload=workload)

        monitor = None
        # One monitor per machine (local rank 0), on the parent, so the compare view shows them.
        if config.system_metrics and rank.local_rank == 0:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(parent_id, sampling_interval=config.system_metrics_interval_s,
                                           resume_logging=bool(resume), tracking_uri=uri,
                                           node_id=socket.gethostname() if nodes(rank) > 1 else None)
            monitor.start()
    except BaseException:
        for run_id in made:  # nothing else would end them: until_done has not begun
            try:
                client.set_terminated(run_id, "FAILED")
            except Exception as exc:
                log.warning("could not mark MLflow run %s FAILED: %s", run_id, reason(exc))
        raise
    return ModeRun(config, mode, rank, uri, experiment_id, parent_id, child_id, children,
                   outbox, monitor, client, reopen=bool(resume))


@contextmanager
def until_done(runs: ModeRun | Untracked) -> Iterator[None]:
    """Ends `runs` FINISHED when the block completes, FAILED on any error, Ctrl-C or SIGTERM, so
    no run is ever left RUNNING by a process that is gone."""
    with stop_signals_unwind() as shield:
        try:
            runs.start()
            yield
        except BaseException:
            shield()
            try:
                runs.end("FAILED", wait_s=FAILED_DRAIN_S)
            except Exception as exc:  # the first error is the one to see; this one only follows
                log.warning("could not mark the MLflow runs FAILED: %s", exc)
            raise
        shield()
        runs.end("FINISHED")


class Untracked:
    """Stands in for a ModeRun when tracking.enabled is false, so callers need no branches."""

    ids: dict = {}

    def start(self) -> None:
        pass

    def log_epoch(self, metrics: dict, rank_metrics: dict) -> None:
        pass

    def log_points(self, parent_points, rank_points) -> None:
        pass

    def log_datasets(self, data_dir: Path, splits: Iterable[str]) -> None:
        pass

    def log_rank_artifacts(self, paths: Iterable[Path]) -> None:
        pass

    def finish_parent(self, model_file: Path, example, artifacts: Iterable[Path], workload: str | None = None) -> None:
        pass

    def end(self, status: str, wait_s: float | None = None) -> None:
        pass


def fail_unfinished(config: TrackingConfig, ids: dict) -> None:
    """Ends FAILED every run of a training (parent and children) still RUNNING: what the launcher
    does when a worker died without a word."""
    if not config.enabled or not ids:
        return
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri())
    for run_id in [ids["parent"], *ids.get("children", {}).values()]:
        try:
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, "FAILED")
        except Exception as exc:  # the training's own error is the one to report
            log.warning("could not mark MLflow run %s FAILED: %s", run_id, exc)
