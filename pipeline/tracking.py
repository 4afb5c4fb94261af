"""Everything MLflow, in one module: no other module imports mlflow (but the logged model's own
code, pipeline/mlflow_model.py, which MLflow runs when it loads the model).

One parent run per mode per training (run name = the mode), and one child run per rank
(`<mode>/rank-<r>`), every rank logging its own. Rank 0 makes the parent and broadcasts its id.
Metrics go out in one batch per epoch and run, never per step, so tracking costs next to nothing.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import re
import socket
import sqlite3
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from pipeline import record, tracking_helper
from pipeline.atomic import in_the_way
from pipeline.config import MODES, TrackingConfig, load_config
from pipeline.errors import PipelineError
from pipeline.runtime.lifecycle import stop_signals_unwind

if TYPE_CHECKING:  # pipeline.parallel imports torch, which compare and send-runs never need
    from pipeline.parallel import Rank

log = logging.getLogger(__name__)
# A run prints the project's own lines. MLflow's INFO lines (schema migrations, "Skip logging GPU
# metrics", a "View run" URL per run, each repeated by every rank) would drown them; its warnings
# stay. MLflow reads these when first imported, which is always after this module; a user's own
# setting wins.
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
# Calls during training go through an outbox that retries until the server answers (see
# pipeline.outbox), so MLflow's own retries (minutes, at its defaults) are kept short.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
# MLflow 3 reports usage to its makers unless told not to. A training pipeline sends nothing its
# user did not ask for (air-gapped clusters, privacy rules): off, unless the user sets it to false.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per download, in a log
DEFAULT_DB = "mlflow.db"
DEFAULT_ARTIFACTS = "mlartifacts"
PARENT_TAG = "mlflow.parentRunId"
HEALTH_TIMEOUT_S = 5
SQLITE_BUSY_S = 30  # how long a SQLite store may be busy with another process before it is an error
# Bytes: SQLite's unix layer takes paths of up to 512 (MAX_PATHNAME), and the store's "-journal" file
# must fit too (measured here: 504 opens, 505 is "unable to open database file").
SQLITE_MAX_PATH = 504
OUTBOX_DIR = "tracking-outbox"  # in the mode's output folder: what a rank could not send yet
FAILED_DRAIN_S = 10  # after a failure, how long ending the runs may wait on the server


def project_root() -> Path:
    """The repository the pipeline runs for, where its own store lives. `dvc exp run --temp` and
    `dvc queue` run each stage in a temporary copy that DVC deletes afterwards, with the real
    repository in DVC_ROOT; a store in that copy would vanish with every run logged to it."""
    return Path(os.environ.get("DVC_ROOT") or ".").resolve()


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else the project's own SQLite file. One with a password in it is
    refused: MLflow and the HTTP client repeat the URI in their errors and logs, which end up in
    rank logs and artifacts."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or sqlite_uri(project_root() / DEFAULT_DB)
    # A database URL's password has nowhere else to go (MLflow reads the account variables for
    # HTTP stores only): that one is masked wherever it is shown.
    if uri.startswith(("http://", "https://")) and shown(uri) != uri:
        raise PipelineError(
            f"MLFLOW_TRACKING_URI={shown(uri)} holds a password, which MLflow would repeat in its messages and logs: "
            f"set MLFLOW_TRACKING_URI={_USERINFO.sub('', uri)} and the account in MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD")
    return uri


def dvc_experiment_facts() -> dict[str, str]:
    """The DVC experiment a run belongs to (set by `dvc exp run`), so a row of `dvc exp show` and
    its MLflow runs find each other."""
    facts = {"dvc_experiment": os.environ.get("DVC_EXP_NAME"),
             "dvc_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV")}
    return {key: value for key, value in facts.items() if value}


# user:password@ after a scheme: up to the last @ before the path, so a raw @ in the password
# is masked too (a raw / is not allowed there, and ends the match).
_PASSWORD = re.compile(r"(?<=://)([^:/@\s]*):[^/\s]*@")
_USERINFO = re.compile(r"(?<=://)[^/\s]*@")


def shown(text: str) -> str:
    """`text` (a URI, or a message that may quote one) as it may be printed or written down: a
    password in a URI (http://user:secret@host) becomes ***. MLflow takes credentials from
    MLFLOW_TRACKING_USERNAME/PASSWORD instead."""
    return _PASSWORD.sub(r"\1:***@", text)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an MLflow call failed with, where it had one."""
    response = getattr(exc, "response", None)  # requests' HTTPError, from artifact uploads
    if getattr(response, "status_code", None):
        return int(response.status_code)
    if hasattr(exc, "get_http_status_code") and getattr(exc, "error_code", "INTERNAL_ERROR") != "INTERNAL_ERROR":
        return int(exc.get_http_status_code())
    return None


REFUSALS = ("Permission denied", "Read-only file system", "readonly database", "Disk quota exceeded",
            "No space left on device", "database or disk is full", "Not a directory", "Is a directory")


# ENOTDIR, EISDIR: a file where the artifact folder goes (or the reverse), which no wait mends.
REFUSING_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR}


def refused(exc: BaseException) -> bool:
    """Whether the store said no, as opposed to being away: waiting on a refusal would never end
    it. No: a 4xx answer (no such run, no permission), a read-only, full or forbidden store
    (whatever status a server wraps that in, or a local folder's errno), a call that cannot be
    taken as it is (ValueError, KeyError, TypeError). Anything else is away: no connection, a
    timeout, a 5xx or 408/429 answer, and errors of libraries this cannot know (cloud SDKs)."""
    if any(reason in str(exc) for reason in REFUSALS):
        return True
    status = _http_status(exc)
    if status is not None:
        return status < 500 and status not in (408, 429)
    if isinstance(exc, OSError):
        return exc.errno in REFUSING_ERRNOS and type(exc).__module__.split(".")[0] not in ("requests", "urllib3")
    return isinstance(exc, (ValueError, KeyError, TypeError)) and type(exc).__module__.split(".")[0] != "mlflow"


def run_deleted(exc: BaseException) -> bool:
    """MLflow's refusal of a call on a run deleted in the UI: "... must be in the 'active' state.
    Current state is deleted."."""
    return "Current state is deleted" in str(exc)


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return shown(text)[:300]


def _schema_advice(uri: str, text: str) -> str:
    """MLflow calls every schema mismatch out of date and says to upgrade; a store written by a
    newer MLflow has a revision this one has never heard of, and no upgrade fixes that."""
    import mlflow

    found = re.search(r"found version (\w+)", text)
    if found and not _known_revision(found[1]):
        return (f"tracking store {shown(uri)}: its schema ({found[1]}) was written by a newer MLflow than this one "
                f"({mlflow.__version__}), and `mlflow db upgrade` cannot fix that; use the MLflow version that wrote "
                "it, or point MLFLOW_TRACKING_URI at another store")
    return (f"tracking store {shown(uri)}: its schema is older than this MLflow's ({mlflow.__version__}); back the "
            f"store up, then run `mlflow db upgrade {shown(uri)}`")


def _known_revision(revision: str) -> bool:
    """Whether this MLflow's migrations include `revision`."""
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    try:
        return ScriptDirectory.from_config(_get_alembic_config(db_url="")).get_revision(revision) is not None
    except Exception:  # alembic raises for a revision it does not know
        return False


@contextmanager
def store_errors(uri: str, doing: str = "opening it") -> Iterator[None]:
    """Any error from MLflow or the database under it, as one line that names the store (without
    its password) and says what to do."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as exc:
        if not (from_tracking(exc) or isinstance(exc, (OSError, ImportError))):  # OSError: a local artifact folder
            raise
        text = _reason(exc)
        status = _http_status(exc)
        if isinstance(exc, ImportError):
            message = (f"tracking store {shown(uri)}: this environment lacks the Python package its database needs "
                       f"({text}); install it (PostgreSQL: psycopg[binary], MySQL: mysqlclient), or use another store")
        elif "out-of-date database schema" in text:
            message = _schema_advice(uri, text)
        elif status == 403 and "Invalid Host header" in text:
            message = (f"tracking server {shown(uri)} refuses the host name this client uses ({text}); start the "
                       "server with --allowed-hosts naming it (e.g. --allowed-hosts THAT_HOST:5000)")
        elif status in (401, 403):
            message = (f"tracking server {shown(uri)} refused this client (HTTP {status}: {text}); set "
                       "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to an account it accepts")
        else:
            message = (f"tracking store {shown(uri)}: {doing} failed ({text}); fix MLFLOW_TRACKING_URI, or set "
                       "tracking.enabled: false to train without tracking")
        raise PipelineError(message) from exc


def from_tracking(exc: BaseException) -> bool:
    """Raised by MLflow, SQLAlchemy, SQLite or the HTTP client under MLflow."""
    module = type(exc).__module__.split(".")[0]
    return module in ("mlflow", "sqlalchemy", "sqlite3", "requests", "urllib3", "alembic")


def sqlite_uri(path: Path) -> str:
    """The SQLAlchemy URL of the SQLite file at `path`. SQLAlchemy reads a raw `?` as the start of
    a query and decodes `%XX`, so a project in `q?x` would log into a file named `q`: those two
    are escaped, and nothing else (MLflow makes the folder of the URL's path as written, undecoded,
    so every other escape would leave an empty folder beside the project: `My%20Projects`)."""
    return "sqlite:///" + str(path).replace("%", "%25").replace("?", "%3F")


def _sqlite_path(uri: str) -> Path | None:
    """The file a sqlite:/// URL names, as SQLAlchemy reads it (its query, if any, is not part of it)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(urllib.parse.unquote(uri.removeprefix("sqlite:///").partition("?")[0]))


def check_store(uri: str) -> None:
    """Fail before any training when runs could not be recorded."""
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=HEALTH_TIMEOUT_S):
                return
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PipelineError(
                f"MLFLOW_TRACKING_URI={shown(uri)}: the tracking server does not answer ({reason}); start it "
                "(mlflow server --host 127.0.0.1 --port 5000), fix the address, or unset "
                f"MLFLOW_TRACKING_URI to record runs in ./{DEFAULT_DB}"
            ) from None
    path = _sqlite_path(uri)
    if path is None:
        return  # another store MLflow knows (a database URL): MLflow itself reports its errors
    if len(os.fsencode(path.absolute())) > SQLITE_MAX_PATH:
        raise PipelineError(
            f"tracking store {uri}: its path is {len(os.fsencode(path.absolute()))} bytes, longer than the "
            f"{SQLITE_MAX_PATH} bytes SQLite can open; run from a shorter folder, or set MLFLOW_TRACKING_URI to a "
            "store with a shorter path (sqlite:////SHORT/PATH/mlflow.db) or to a tracking server")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PipelineError(f"tracking store {uri}: cannot write {path}; fix its permissions or MLFLOW_TRACKING_URI")
    check_artifact_folder(project_root() / DEFAULT_ARTIFACTS)
    try:
        _use_wal(path)
        _can_write(path)
    except sqlite3.Error as exc:
        if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
            raise PipelineError(
                f"tracking store {uri}: another process has held {path} locked for over {SQLITE_BUSY_S} s (an open "
                "write transaction: a `sqlite3` shell, a backup, another tool); end it, then run again") from None
        raise PipelineError(f"tracking store {uri}: {path} is not a usable SQLite database ({exc}); move it away "
                            "to start a new store, or point MLFLOW_TRACKING_URI at another one") from None


def check_artifact_folder(folder: Path) -> None:
    """The default store's artifact folder is a folder this process can write into, or can be
    made: found before training, not as an 'outage' once it is over."""
    in_the_way(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)  # a folder, then
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        why = "Read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "Permission denied"
        raise PipelineError(f"{folder}: the MLflow artifact folder cannot be written ({existing}: {why}); fix "
                            "that, or set MLFLOW_TRACKING_URI to another store")


def _can_write(path: Path) -> None:
    """A write transaction can begin, waiting for another process's to end as long as a busy store
    may take (MLflow's own engine waits SQLite's default 5 s, and would fail the training's start
    after the disk changed)."""
    with closing(sqlite3.connect(path, timeout=SQLITE_BUSY_S, isolation_level=None)) as db:
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")


def _use_wal(path: Path, patience_s: float = SQLITE_BUSY_S) -> None:
    """WAL lets one writer and many readers work at once: without it, ranks that log at the same
    moment get "database is locked". The mode is stored in the file, so setting it once is enough.
    Switching needs the file to itself, and SQLite answers "locked" at once, without waiting out
    its busy timeout, while another process writes (an `mlflow ui` making a new store's tables
    when the training starts): so the switch is retried for a while before it is an error."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            with closing(sqlite3.connect(path, timeout=patience_s)) as db:
                db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def preflight(config: TrackingConfig) -> str | None:
    """Everything about the store that a training can check before it changes the disk: the
    store answers, its schema is this MLflow's, the server accepts this host and client, the
    experiment name is accepted and the experiment not deleted. Returns the experiment's id."""
    if not config.enabled:
        return None
    from mlflow import MlflowClient

    uri = tracking_uri()
    check_store(uri)
    with store_errors(uri, f"opening experiment {config.experiment!r}"):
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(config.experiment)
        if experiment is not None and experiment.lifecycle_stage != "active":
            raise PipelineError(
                f"tracking.experiment = {config.experiment!r} is deleted in {shown(uri)}: restore it (`mlflow "
                f"experiments restore --experiment-id {experiment.experiment_id}`) or choose another name")
        return _experiment_id(client, config.experiment, uri)


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


def check_worker_store(rank: Rank) -> None:
    """In each DDP worker, before the process group: with ranks on several machines, a store that
    is a file on one machine's disk would split the runs across machines (each node its own
    mlflow.db), so every rank refuses it alike; rank 0 also checks that the store answers."""
    from pipeline.parallel import nodes

    uri = tracking_uri()
    local_file = uri.startswith(("sqlite:", "file:")) or "://" not in uri
    if nodes(rank) > 1 and local_file:
        raise PipelineError(
            f"rank {rank.rank}: the ranks run on {nodes(rank)} nodes, but the tracking store is {shown(uri)}, a file "
            "on each node's own disk. Set MLFLOW_TRACKING_URI on every node to one tracking server they all "
            "reach (e.g. `mlflow server --host 0.0.0.0 --port 5000` on one machine, then "
            "MLFLOW_TRACKING_URI=http://THAT_HOST:5000), or set tracking.enabled: false")
    if rank.is_main:
        check_store(uri)


def git_facts() -> dict[str, str]:
    commit = record.git("rev-parse", "HEAD").strip()
    dirty = record.git("status", "--porcelain", "--untracked-files=no").strip()
    return {"git_commit": commit or "unknown", "git_dirty": str(bool(dirty)).lower() if commit else "unknown"}


def _log_uncommitted_change(client, parent_id: str) -> None:
    """A dirty tree's change, on the parent run, so that the run can still be re-made from its
    record (`mnist-pipeline reproduce`); the tag says where it is."""
    import tempfile

    patch = record.uncommitted_patch()
    if patch:
        with tempfile.TemporaryDirectory() as folder:  # bytes as git wrote them: no text round trip
            path = Path(folder) / record.PATCH_FILE
            path.write_bytes(patch)
            client.log_artifact(parent_id, str(path), record.PATCH_FOLDER)
        client.set_tag(parent_id, "git_patch", record.PATCH_ARTIFACT)


def _metric_batch(points: Iterable[tuple[str, float, int]]) -> list:
    """(key, value, step) triples as MLflow metrics, all stamped now."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(key, float(value), now, step) for key, value, step in points]


def _numeric(values: dict[str, Any], step: int) -> list[tuple[str, float, int]]:
    """The numeric entries of `values` at `step` (lists, like per-rank checksums, are not metrics)."""
    return [(k, v, step) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _as_params(flat: dict[str, Any]) -> list:
    from mlflow.entities import Param

    return [Param(key, str(value)) for key, value in flat.items()]


def _file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _dataset_inputs(data_dir: Path, splits: Iterable[str]) -> list:
    """The prepared splits a run read, as MLflow datasets (the UI's Dataset column): the file, its
    digest, and the MNIST files it came from with the MD5s the prepare stage verified."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    from pipeline.prepared import load_stats

    stats = load_stats(data_dir)
    inputs = []
    for split in splits:
        path = Path(data_dir) / f"{split}.pt"
        origin = "t10k-" if split == "test" else "train-"  # val is carved out of MNIST's training files
        profile = {"images": stats["splits"][split]["count"], "class_counts": stats["splits"][split]["class_counts"],
                   "mnist_files_md5": {name: f["md5"] for name, f in stats["sources"].items() if name.startswith(origin)},
                   "checksums_verified": stats["checksums_verified"]}
        dataset = Dataset(name=f"mnist-{split}", digest=_file_md5(path)[:10], source_type="local",
                          source=json.dumps({"uri": str(path)}), profile=json.dumps(profile))
        inputs.append(DatasetInput(dataset, [InputTag("mlflow.data.context", split)]))
    return inputs


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
                log.warning("could not mark MLflow run %s %s: %s", run_id, status, _reason(exc))

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
        parent = _numeric({k: v for k, v in metrics.items() if k != "epoch"}, step)  # the step says it
        # The loss curve within the epoch, at the training step each window ends on.
        parent += [("train_loss_window", loss, int(at)) for at, loss in metrics.get("loss_windows", ())]
        own = _numeric(rank_metrics, step) + [("step_loss", v, s) for s, v in rank_metrics.get("step_losses", ())]
        self.log_points(parent, own)

    def log_points(self, parent_points: Iterable[tuple[str, float, int]],
                   rank_points: Iterable[tuple[str, float, int]]) -> None:
        """(key, value, step) series in one batch per run: the parent's from rank 0, and this rank's."""
        if self.rank.is_main:
            self.outbox.put({"op": "metrics", "run": self.parent_id, "points": _stamped(parent_points)})
        self.outbox.put({"op": "metrics", "run": self.child_id, "points": _stamped(rank_points)})

    def log_datasets(self, data_dir: Path, splits: Iterable[str]) -> None:
        """Rank 0: the splits training read, on the parent run (at the start, with the runs)."""
        if self.rank.is_main:
            self._client.log_inputs(self.parent_id, datasets=_dataset_inputs(data_dir, splits))

    def log_rank_artifacts(self, paths: Iterable[Path]) -> None:
        for path in paths:
            self.outbox.put({"op": "artifact", "run": self.child_id, "path": str(path)})

    def finish_parent(self, model_file: Path, example, artifacts: Iterable[Path]) -> None:
        """Rank 0: the mode's files and its model (read back from `model_file`, with signature and
        `example` as input example) on the parent run."""
        for path in artifacts:
            self.outbox.put({"op": "artifact", "run": self.parent_id, "path": str(path)})
        self.outbox.put({"op": "model", "run": self.parent_id, "file": str(model_file), "mode": self.mode,
                         "example": example.tolist(), "registered": self.config.registered_model or None})

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
                    f"trained ({_reason(refusal)}). Training's outputs are saved; what rank {self.rank.rank} could not "
                    f"send ({left} calls) is kept in {self.outbox.path}, for runs that are gone: drop it with "
                    f"`mnist-pipeline send-runs --mode {self.mode} --discard`, or restore the runs in the UI and "
                    f"`mnist-pipeline send-runs --mode {self.mode}`; a new training makes new runs")
            raise PipelineError(
                f"{self.mode}: the tracking store {shown(self.uri)} refused this training's tracking "
                f"({_reason(refusal)}). Training's outputs are saved; what rank {self.rank.rank} could not send "
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


def _stamped(points: Iterable[tuple[str, float, int]]) -> list[list]:
    """(key, value, step) as [key, value, step, time in ms]: stamped when measured, not when sent."""
    now = int(time.time() * 1000)
    return [[key, float(value), step, now] for key, value, step in points]


class _Direct:
    """An outbox that sends at once, for short runs with nothing worth keeping (commcheck's)."""

    path = None
    last_error = None
    refusal = None

    def __init__(self, deliver):
        self._deliver = deliver

    def put(self, op: dict) -> None:
        self._deliver(op)

    def drain(self, timeout_s: float) -> int:
        return 0

    def close(self) -> None:
        pass


def _deliver(client, uri: str, op: dict) -> None:
    """One outbox entry, sent. Idempotent: metrics already stored are skipped by MLflow, files
    are overwritten, and a run ends with the last status set."""
    kind = op["op"]
    if kind == "metrics":
        from mlflow.entities import Metric

        client.log_batch(op["run"], metrics=[Metric(key, value, ts, step) for key, value, step, ts in op["points"]])
    elif kind == "artifact":
        if Path(op["path"]).is_file():
            absolute = Path(os.path.abspath(op["path"]))
            if absolute.resolve() != absolute:  # checked when read; a link may have been put on its way since
                raise ValueError(f"{op['path']} now goes through a symbolic link: not uploaded")
            client.log_artifact(op["run"], op["path"])
    elif kind == "model":
        _log_model(client, uri, op)
    elif kind == "end":
        client.set_terminated(op["run"], op["status"])
    else:
        raise ValueError(f"unknown tracking operation {kind!r}")


def _log_model(client, uri: str, op: dict) -> None:
    """The model a mode saved, as an MLflow model on its parent run (and, opted in, registered):
    models-from-code (pipeline/mlflow_model.py) with the weights file beside it, so loading it
    never unpickles anything from the artifact store."""
    import mlflow
    import torch
    from mlflow.models import Model, infer_signature

    from pipeline import mlflow_model

    path = Path(op["file"])
    if not path.is_file():
        log.warning("%s: gone, so its MLflow model is not logged", path)
        return
    example = torch.tensor(op["example"], dtype=torch.float32)
    with torch.no_grad():
        output = mlflow_model.build_from_weights(str(path))(example).numpy()
    example = example.numpy()
    mlflow.set_tracking_uri(uri)
    # Into the run's experiment, by run id: mlflow.start_run(run_id=...) would set the run
    # RUNNING, then FINISHED on the way out, whatever status the training ended it with.
    mlflow.set_experiment(experiment_id=client.get_run(op["run"]).info.experiment_id)
    registered = op.get("registered")
    code = mlflow_model.__file__
    with _requirements_known_met():
        info = Model.log(
            None,  # artifact_path, which MLflow 3 replaced by name
            name="model",
            flavor=mlflow.pyfunc,
            run_id=op["run"],
            python_model=code,
            artifacts={mlflow_model.WEIGHTS: str(path)},
            input_example=example,
            signature=infer_signature(example, output),
            # Pinned, not inferred: inference reloads the model in a subprocess, which is slow.
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"],
            registered_model_name=registered,
            flavor_name=mlflow.pyfunc._get_pyfunc_model_flavor_name(code),
        )
    # The weights as logged, by content: what `mnist-pipeline reproduce` compares a re-made run's with.
    client.set_tag(op["run"], "weights_sha256", record.saved_weights_digest(path))
    if registered:  # the mode names its version: models:/<name>@<mode> is what that mode trained
        version = str(info.registered_model_version)
        client.set_registered_model_alias(registered, op["mode"], version)
        for key, value in {"mode": op["mode"], "run_id": op["run"], **git_facts()}.items():
            client.set_model_version_tag(registered, version, key, value)


@contextmanager
def _requirements_known_met() -> Iterator[None]:
    """Model.log without MLflow's check that this environment satisfies the model's pip
    requirements (made when it saves the model, and again when it loads it back to validate the
    input example): they are pinned to the very torch and MLflow running here, so it cannot find
    a mismatch, and it costs more than half a bare torch import per process (it reads the file list
    of every installed package; benchmarks/pipeline_overhead.py). Where a newer MLflow moved the
    check, it runs as before."""
    from contextlib import ExitStack
    from unittest import mock

    import mlflow.pyfunc
    from mlflow.utils import environment

    with ExitStack() as patches:
        for module in (environment, mlflow.pyfunc):
            if hasattr(module, "warn_dependency_requirement_mismatches"):
                patches.enter_context(mock.patch.object(module, "warn_dependency_requirement_mismatches",
                                                        lambda requirements: None))
        yield


def load_model(model_uri: str):
    """The network a mode logged (`runs:/ID/model`, `models:/NAME@ddp`), built by this package's
    code from the logged weights alone: nothing from the artifact store is run or unpickled, so
    whoever can write to the store cannot run code on whoever loads the model."""
    import tempfile

    from pipeline.mlflow_model import build_from_weights

    with tempfile.TemporaryDirectory() as tmp:
        return build_from_weights(str(download_weights(model_uri, Path(tmp))))


def download_weights(model_uri: str, folder: Path) -> Path:
    """The weights file (a mode's model.pt) of a logged model, downloaded into `folder`."""
    import mlflow
    import yaml

    from pipeline.mlflow_model import WEIGHTS

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(folder)))
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    weights = (local / flavor["artifacts"][WEIGHTS]["path"]).resolve()
    if not weights.is_relative_to(local.resolve()):
        raise PipelineError(f"{model_uri}: its MLmodel points outside the model ({weights}); not loaded")
    return weights


OPS = ("metrics", "artifact", "model", "end")
RUN_ID = re.compile(r"[0-9a-f]{32}")


def _own_file(path: str, root: Path) -> Path:
    """`path` if it is a file under `root` reached without a symbolic link, else ValueError: a
    link planted in a shared folder must not make the pipeline upload what it points to."""
    absolute = Path(os.path.abspath(path))
    if absolute.resolve() != absolute:
        raise ValueError(f"{path} goes through a symbolic link: not uploaded")
    if not absolute.is_relative_to(root):
        raise ValueError(f"{path} is outside {root}: only the mode's own files are uploaded")
    return absolute


def op_checker(mode_dir: Path, run_ids: Iterable[str] | None = None, registered: str | None = None):
    """What an outbox line may ask, vetted before it is sent: the file is on a disk others may
    write to (a shared volume), so it is data, not code. A line may only make a known call, on
    one of this training's runs (`run_ids`: those in mlflow_run.json), upload files under the
    mode's own folder, register the model under the name the settings give (`registered`), and
    end a run only as MLflow does."""
    root = Path(os.path.abspath(mode_dir)).resolve()
    allowed = set(run_ids) if run_ids is not None else None

    def check(op: dict) -> None:
        kind, run = op.get("op"), str(op.get("run", ""))
        if kind not in OPS:
            raise ValueError(f"unknown operation {kind!r}")
        if not RUN_ID.fullmatch(run):
            raise ValueError(f"{run!r} is not a run id")
        if allowed is not None and run not in allowed:
            raise ValueError(f"run {run} is not one of this training's runs (mlflow_run.json)")
        if kind == "metrics":
            points = op.get("points")
            if not isinstance(points, list) or not all(
                    isinstance(p, list) and len(p) == 4 and isinstance(p[0], str) and isinstance(p[1], (int, float))
                    and math.isfinite(p[1]) and all(isinstance(v, int) for v in p[2:]) for p in points):
                raise ValueError("metrics must be [name, finite value, step, time] lists")
        elif kind == "artifact":
            _own_file(str(op.get("path")), root)
        elif kind == "model":
            _own_file(str(op.get("file")), root)
            if op.get("mode") != Path(mode_dir).name or not isinstance(op.get("example"), list):
                raise ValueError(f"a model of mode {op.get('mode')!r}, not {Path(mode_dir).name}'s")
            if (op.get("registered") or None) != (registered or None):
                raise ValueError(f"registers the model as {op.get('registered')!r}; tracking.registered_model says "
                                 f"{registered or 'none'!r}")
        elif op.get("status") not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"{op.get('status')!r} is not how a run ends")

    return check


def _outbox(folder: Path | None, rank: Rank, uri: str, run_ids: Iterable[str] | None = None,
            registered: str | None = None):
    from functools import partial

    from mlflow import MlflowClient

    from pipeline.outbox import Outbox

    deliver = partial(_deliver, MlflowClient(uri), uri)  # a client of its own for the sender thread
    if folder is None:
        return _Direct(deliver)
    return Outbox(folder, f"rank-{rank.rank}", deliver, target=shown(uri), refused=refused,
                  check=op_checker(folder.parent, run_ids, registered))


def send_kept(folder: Path, uri: str | None = None, registered: str | None = None) -> int | None:
    """Send what trainings left in `folder` (a mode's outbox) to the current store (`uri`, else
    MLFLOW_TRACKING_URI or the default): the `send-runs` command. Where the calls go is the
    user's setting now, never what a file says; a line may only touch the runs the mode's
    mlflow_run.json names. Returns how many calls were sent (None: nothing was kept)."""
    from functools import partial

    from mlflow import MlflowClient

    from pipeline.atomic import read_json
    from pipeline.outbox import DeliveryFailed, replay

    if uri is not None and shown(uri) != uri:
        raise PipelineError(f"--to {shown(uri)} holds a password: give the URI without it, and the account in "
                            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
    uri = uri or tracking_uri()
    kept = sorted(folder.glob("rank-*.jsonl")) if folder.is_dir() else []
    if not kept:
        return None
    check_store(uri)
    ids_file = folder.parent / "mlflow_run.json"
    discard = f"`mnist-pipeline send-runs --mode {folder.parent.name} --discard`"
    ids = read_json(ids_file, f"it names the runs these calls belong to; drop them with {discard}") \
        if ids_file.is_file() else {}
    if not isinstance(ids, dict) or "parent" not in ids:
        raise PipelineError(f"{ids_file}: missing or without run ids, so nothing says which runs the calls kept in "
                            f"{folder} belong to; none is sent. Drop them with {discard}")
    run_ids = [ids["parent"], *ids.get("children", {}).values()]
    sent = 0
    for path in kept:
        target = path.with_suffix(".target")
        made_for = shown(target.read_text(errors="replace").strip()) if target.is_file() else "(not recorded)"
        deliver = partial(_deliver, MlflowClient(uri), uri)
        try:
            sent += replay(path, deliver, op_checker(folder.parent, run_ids, registered))
        except DeliveryFailed as failed:
            exc = failed.cause
            if _http_status(exc) == 404:
                raise PipelineError(
                    f"{failed.where}: its run is not in the tracking store {shown(uri)} (these calls were made for "
                    f"{made_for}); set MLFLOW_TRACKING_URI to that store and run send-runs again, or drop what is "
                    f"kept with {discard}") from None
            if from_tracking(exc) and not refused(exc):
                with store_errors(uri, f"sending {failed.where}"):
                    raise exc from None
            raise PipelineError(f"{failed.where}: the tracking store {shown(uri)} refused it ({_reason(exc)}); fix "
                                f"what it says and run send-runs again, or drop what is kept with {discard}") from None
    return sent


# MLflow 3's UI opens an experiment on its GenAI pages (traces, token usage) unless the experiment
# says it holds model training; the link's workflowType switches the sidebar to match.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
UI_DEFAULT = "http://127.0.0.1:5000"  # where `make ui` serves the default store


def _experiment_id(client, name: str, uri: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        # With the local SQLite store, artifacts go to ./mlartifacts (a server decides for itself).
        location = (project_root() / DEFAULT_ARTIFACTS).as_uri() if _sqlite_path(uri) else None
        return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    if experiment.tags.get("mlflow.experimentKind") is None:  # made before this tag, or by hand
        for key, value in EXPERIMENT_KIND.items():
            client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def print_ui_link() -> None:
    """For `make ui`: the links to the last training in this checkout: its runs, every mode side
    by side, and each distributed mode's ranks side by side."""
    trained = {}
    for mode in listed_modes():  # a mode dropped from train.modes may have runs of another experiment
        path = Path("models") / mode / "mlflow_run.json"
        ids = json.loads(path.read_text()) if path.is_file() else {}
        if ids.get("parent"):  # {}: trained with tracking off
            trained[mode] = ids
    if not trained:
        print(f"MLflow UI: {UI_DEFAULT} (nothing tracked yet: make run)")
        return
    experiment = next(iter(trained.values()))["experiment_id"]
    print(f"MLflow: the mode runs side by side at {ui_link(experiment)}")
    modes = [mode for mode in trained if trained[mode]["experiment_id"] == experiment]
    print(f"MLflow: the last training's modes compared at {compare_link(experiment, [trained[m]['parent'] for m in modes])}")
    for mode in modes:
        ranks = trained[mode].get("children", {})
        if len(ranks) > 1:
            print(f"MLflow: the {mode} ranks compared at {compare_link(experiment, ranks.values())}")


def listed_modes() -> tuple[str, ...]:
    """params.yaml's train.modes; every mode where it cannot be read (make ui is no place to fail)."""
    try:
        return load_config("params.yaml").train.modes
    except (PipelineError, OSError):
        return MODES


def _ui_base(uri: str | None) -> str:
    """The UI of the server in MLFLOW_TRACKING_URI, or `make ui`'s for the default store."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "")  # not tracking_uri(): a link is no use of the account
    if not uri.startswith(("http://", "https://")):
        return UI_DEFAULT
    parts = urllib.parse.urlsplit(uri)  # a link to print: the browser asks for the account itself
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])).rstrip("/")


def ui_link(experiment_id: str, uri: str | None = None) -> str:
    """The page that shows this experiment's training runs."""
    return f"{_ui_base(uri)}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def compare_link(experiment_id: str, run_ids: Iterable[str], uri: str | None = None) -> str:
    """MLflow's compare page for these runs: every param and metric side by side."""
    # Percent-encoded: a terminal ends a link at a bracket or quote, MLflow's page decodes them.
    def encoded(values: Iterable[str]) -> str:
        return urllib.parse.quote(json.dumps(list(values), separators=(",", ":")), safe=",")

    return (f"{_ui_base(uri)}/#/compare-runs?runs={encoded(run_ids)}&experiments={encoded([experiment_id])}"
            "&workflowType=machine_learning")


def start_mode_run(config: TrackingConfig, mode: str, rank: Rank, tags: dict[str, str], params: dict[str, Any],
                   resume: dict | None = None, outbox_dir: Path | None = None) -> ModeRun | Untracked:
    """Open (or, on resume, find again) the parent run on rank 0 and a child run on every rank. What is
    logged afterwards is kept in `outbox_dir` until the server has it (None: sent at once)."""
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
                    experiment_id = _experiment_id(client, config.experiment, uri)
                    run_tags = {**tags, **git_facts(), **dvc_experiment_facts(), "host": socket.gethostname()}
                    parent_id = client.create_run(experiment_id, run_name=mode, tags=run_tags).info.run_id
                    made.append(parent_id)
                    client.log_batch(parent_id, params=_as_params(params))
                    _log_uncommitted_change(client, parent_id)
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
                child_id = client.create_run(experiment_id, run_name=f"{mode}/rank-{rank.rank}",
                                             tags=child_tags).info.run_id
            made.append(child_id)
        children = dict(enumerate(all_gather_objects(child_id, rank)))
        outbox = _outbox(outbox_dir, rank, uri, run_ids=[parent_id, *children.values()],
                         registered=config.registered_model)

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
                log.warning("could not mark MLflow run %s FAILED: %s", run_id, _reason(exc))
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

    def finish_parent(self, model_file: Path, example, artifacts: Iterable[Path]) -> None:
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


def log_to_mode_run(config: TrackingConfig, ids: dict, metrics: dict[str, float], artifacts: Iterable[Path],
                    artifact_dir: str | None = None, datasets: tuple[Path, Iterable[str]] | None = None,
                    tags: dict[str, str] | None = None) -> None:
    """Add a later stage's numbers, tags, files and the splits it read (`(data_dir, splits)`) to
    the parent run a training made (see mlflow_run.json)."""
    if not config.enabled or not ids:
        return
    metrics = {key: value for key, value in metrics.items() if isinstance(value, (int, float))}
    if tracking_helper.call("log_to_mode_run", config=dataclasses.asdict(config), ids=ids, metrics=metrics,
                            artifacts=[str(path) for path in artifacts], artifact_dir=artifact_dir,
                            datasets=datasets and (str(datasets[0]), list(datasets[1])), tags=tags) \
            is not tracking_helper.NOT_SENT:
        return
    from mlflow import MlflowClient

    uri = tracking_uri()
    with store_errors(uri, f"logging to run {ids['parent']}"):
        client = MlflowClient(uri)  # in here: it opens the store (a SQL store checks its schema)
        client.log_batch(ids["parent"], metrics=_metric_batch(_numeric(metrics, step=0)))
        for key, value in (tags or {}).items():
            client.set_tag(ids["parent"], key, value)
        if datasets is not None:
            client.log_inputs(ids["parent"], datasets=_dataset_inputs(*datasets))
        for path in artifacts:
            client.log_artifact(ids["parent"], str(path), artifact_dir)


def log_compare_run(config: TrackingConfig, mode_ids: dict[str, dict], artifacts: Iterable[Path]) -> str | None:
    """A `compare` run holding the report, tagged with (and linking to) the mode runs it compares."""
    ids = {mode: value for mode, value in mode_ids.items() if value}
    if not config.enabled or not ids:
        return None
    sent = tracking_helper.call("log_compare_run", config=dataclasses.asdict(config), mode_ids=mode_ids,
                                artifacts=[str(path) for path in artifacts])
    if sent is not tracking_helper.NOT_SENT:
        return sent
    from mlflow import MlflowClient

    uri = tracking_uri()
    experiment_id = next(iter(ids.values()))["experiment_id"]
    # The description (mlflow.note.content) is Markdown in the UI: one link per mode run.
    links = " | ".join(f"[{mode}](#/experiments/{v['experiment_id']}/runs/{v['parent']})" for mode, v in ids.items())
    tags = {f"run_id.{mode}": value["parent"] for mode, value in ids.items()}
    tags.update({"mlflow.note.content": f"Compares the mode runs: {links}", **git_facts(), **dvc_experiment_facts()})
    with store_errors(uri, "logging the compare run"):
        client = MlflowClient(uri)  # in here: it opens the store (a SQL store checks its schema)
        run_id = client.create_run(experiment_id, run_name="compare", tags=tags).info.run_id
        try:
            for path in artifacts:
                client.log_artifact(run_id, str(path))
        except BaseException:
            client.set_terminated(run_id, "FAILED")
            raise
        client.set_terminated(run_id, "FINISHED")
    return run_id
