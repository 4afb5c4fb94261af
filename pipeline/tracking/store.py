"""Where runs go and whether they can: the tracking URI (the project's SQLite file unless
MLFLOW_TRACKING_URI says otherwise, never with a password in it), the checks made before anything
trains, and any error of the store as one line that says what to do."""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import closing, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from pipeline.atomic import in_the_way
from pipeline.config import TrackingConfig
from pipeline.errors import ConfigError, PipelineError

if TYPE_CHECKING:  # pipeline.parallel imports torch, which compare and send-runs never need
    from pipeline.parallel import Rank

DEFAULT_DB = "mlflow.db"
DEFAULT_ARTIFACTS = "mlartifacts"
HEALTH_TIMEOUT_S = 5
SQLITE_BUSY_S = 30  # how long a SQLite store may be busy with another process before it is an error
# Bytes: SQLite's unix layer takes paths of up to 512 (MAX_PATHNAME), and the store's "-journal" file
# must fit too (measured here: 504 opens, 505 is "unable to open database file").
SQLITE_MAX_PATH = 504


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


# user:password@ after a scheme: up to the last @ before the path, so a raw @ in the password
# is masked too (a raw / is not allowed there, and ends the match).
_PASSWORD = re.compile(r"(?<=://)([^:/@\s]*):[^/\s]*@")
_USERINFO = re.compile(r"(?<=://)[^/\s]*@")


def shown(text: str) -> str:
    """`text` (a URI, or a message that may quote one) as it may be printed or written down: a
    password in a URI (http://user:secret@host) becomes ***. MLflow takes credentials from
    MLFLOW_TRACKING_USERNAME/PASSWORD instead."""
    return _PASSWORD.sub(r"\1:***@", text)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an MLflow call failed with, where it had one."""
    response = getattr(exc, "response", None)  # requests' HTTPError, from artifact uploads
    if getattr(response, "status_code", None):
        return int(response.status_code)
    if (bucket := bucket_status(exc)) is not None:
        return bucket
    if hasattr(exc, "get_http_status_code") and getattr(exc, "error_code", "INTERNAL_ERROR") != "INTERNAL_ERROR":
        return int(exc.get_http_status_code())
    return None


def bucket_status(exc: BaseException) -> int | None:
    """The status an S3 bucket answered (botocore's ClientError keeps it in a dict), also under
    boto3's S3UploadFailedError, raised while handling it, with which MLflow's uploads fail."""
    if type(exc).__module__.split(".")[0] not in ("boto3", "botocore", "s3transfer"):
        return None
    for link in (exc, exc.__cause__, exc.__context__):
        response = getattr(link, "response", None)
        if isinstance(response, dict) and (status := response.get("ResponseMetadata", {}).get("HTTPStatusCode")):
            return int(status)
    return None


REFUSALS = ("Permission denied", "Read-only file system", "readonly database", "Disk quota exceeded",
            "No space left on device", "database or disk is full", "Not a directory", "Is a directory")


# ENOTDIR, EISDIR: a file where the artifact folder goes (or the reverse), which no wait mends.
REFUSING_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR}


# What a bucket answers when it is busy or the request was slow, whatever the status: asked again
# later, it answers (S3's error codes; 400 RequestTimeout, 409 OperationAborted, 403 RequestTimeTooSkewed).
BUCKET_OUTAGES = {"RequestTimeout", "OperationAborted", "SlowDown", "InternalError", "ServiceUnavailable",
                  "RequestTimeTooSkewed"}


def bucket_error_code(exc: BaseException) -> str | None:
    for link in (exc, exc.__cause__, exc.__context__):
        response = getattr(link, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            return str(response["Error"]["Code"])
    return None


def refused(exc: BaseException) -> bool:
    """Whether the store said no, as opposed to being away: waiting on a refusal would never end
    it. No: a 4xx answer (no such run, no permission), a read-only, full or forbidden store
    (whatever status a server wraps that in, or a local folder's errno), a call that cannot be
    taken as it is (ValueError, KeyError, TypeError). Anything else is away: no connection, a
    timeout, a 5xx or 408/429 answer, and errors of libraries this cannot know (cloud SDKs)."""
    if any(reason in str(exc) for reason in REFUSALS):
        return True
    if bucket_status(exc) is not None and bucket_error_code(exc) in BUCKET_OUTAGES:
        return False
    status = http_status(exc)
    if status is not None:
        return status < 500 and status not in (408, 429)
    if isinstance(exc, OSError):
        return exc.errno in REFUSING_ERRNOS and type(exc).__module__.split(".")[0] not in ("requests", "urllib3")
    if isinstance(exc, ConfigError):  # a call that can never be made as it is: a model's workload refused
        return True
    return isinstance(exc, (ValueError, KeyError, TypeError)) and type(exc).__module__.split(".")[0] != "mlflow"


def run_deleted(exc: BaseException) -> bool:
    """MLflow's refusal of a call on a run deleted in the UI: "... must be in the 'active' state.
    Current state is deleted."."""
    return "Current state is deleted" in str(exc)


def reason(exc: BaseException) -> str:
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
        text = reason(exc)
        status = http_status(exc)
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
    """Raised by MLflow, SQLAlchemy, SQLite, the HTTP client under MLflow, or its S3 client."""
    module = type(exc).__module__.split(".")[0]
    return module in ("mlflow", "sqlalchemy", "sqlite3", "requests", "urllib3", "alembic",
                      "boto3", "botocore", "s3transfer")  # the last three: MLflow's S3 artifacts


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
        return open_experiment(client, config.experiment, uri)


# MLflow 3's UI opens an experiment on its GenAI pages (traces, token usage) unless the experiment
# says it holds model training; the link's workflowType switches the sidebar to match.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def open_experiment(client, name: str, uri: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        # With the local SQLite store, artifacts go to ./mlartifacts (a server decides for itself).
        location = (project_root() / DEFAULT_ARTIFACTS).as_uri() if _sqlite_path(uri) else None
        try:
            return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
        except MlflowException as exc:  # made meanwhile by another training: a sweep's tasks start together
            experiment = client.get_experiment_by_name(name) if exc.error_code == "RESOURCE_ALREADY_EXISTS" else None
            if experiment is None:
                raise
    if experiment.tags.get("mlflow.experimentKind") is None:  # made before this tag, or by hand
        for key, value in EXPERIMENT_KIND.items():
            client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def is_local_file(uri: str) -> bool:
    """A store that is a file on this machine's disk (SQLite, or MLflow's file store)."""
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


def check_worker_store(rank: Rank) -> None:
    """In each DDP worker, before the process group: with ranks on several machines, a store that
    is a file on one machine's disk would split the runs across machines (each node its own
    mlflow.db), so every rank refuses it alike; rank 0 also checks that the store answers."""
    from pipeline.parallel import nodes

    uri = tracking_uri()
    if nodes(rank) > 1 and is_local_file(uri):
        raise PipelineError(
            f"rank {rank.rank}: the ranks run on {nodes(rank)} nodes, but the tracking store is {shown(uri)}, a file "
            "on each node's own disk. Set MLFLOW_TRACKING_URI on every node to one tracking server they all "
            "reach (e.g. `mlflow server --host 0.0.0.0 --port 5000` on one machine, then "
            "MLFLOW_TRACKING_URI=http://THAT_HOST:5000), or set tracking.enabled: false")
    if rank.is_main:
        check_store(uri)


def import_sql_store() -> None:
    """MLflow and its SQL store (the default store, which every rank opens), imported ahead of the
    first call: by the fork server, once for every DDP worker it forks."""
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
