"""How a tracking call reaches the store: at once (commcheck), or through a rank's outbox that
keeps it on disk until the server takes it; what a kept call may ask, vetted before it is sent;
and `send-runs`, which sends what a training left."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from pipeline.errors import PipelineError
from pipeline.tracking.model import EXAMPLE_DTYPES, log_model
from pipeline.tracking.store import (check_store, from_tracking, http_status, reason, refused, shown, store_errors,
                                     tracking_uri)

if TYPE_CHECKING:  # pipeline.parallel imports torch, which send-runs never needs
    from pipeline.parallel import Rank

OUTBOX_DIR = "tracking-outbox"  # in the mode's output folder: what a rank could not send yet


def stamped(points: Iterable[tuple[str, float, int]]) -> list[list]:
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
        log_model(client, uri, op)
    elif kind == "end":
        client.set_terminated(op["run"], op["status"])
    else:
        raise ValueError(f"unknown tracking operation {kind!r}")


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


def op_checker(mode_dir: Path, run_ids: Iterable[str] | None = None, registered: str | None = None,
               workload: str | None = None):
    """What an outbox line may ask, vetted before it is sent: the file is on a disk others may
    write to (a shared volume), so it is data, not code. A line may only make a known call, on
    one of this training's runs (`run_ids`: those in mlflow_run.json), upload files under the
    mode's own folder, register the model under the name the settings give (`registered`), build
    it by the workload they name (`workload`: a class path outside the package is imported, so
    no file may choose it), and end a run only as MLflow does."""
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
            if op.get("example_dtype", "float32") not in EXAMPLE_DTYPES:
                raise ValueError(f"an input example of type {op.get('example_dtype')!r}, not one of {EXAMPLE_DTYPES}")
            if (op.get("registered") or None) != (registered or None):
                raise ValueError(f"registers the model as {op.get('registered')!r}; tracking.registered_model says "
                                 f"{registered or 'none'!r}")
            if (op.get("workload") or None) not in (None, workload):
                raise ValueError(f"builds the model by workload {op.get('workload')!r}; workload.class_path says "
                                 f"{workload!r}")
        elif op.get("status") not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"{op.get('status')!r} is not how a run ends")

    return check


def outbox_for(folder: Path | None, rank: Rank, uri: str, run_ids: Iterable[str] | None = None,
               registered: str | None = None, workload: str | None = None):
    from functools import partial

    from mlflow import MlflowClient

    from pipeline.tracking.outbox import Outbox

    deliver = partial(_deliver, MlflowClient(uri), uri)  # a client of its own for the sender thread
    if folder is None:
        return _Direct(deliver)
    return Outbox(folder, f"rank-{rank.rank}", deliver, target=shown(uri), refused=refused,
                  check=op_checker(folder.parent, run_ids, registered, workload))


def send_kept(folder: Path, uri: str | None = None, registered: str | None = None,
              workload: str | None = None) -> int | None:
    """Send what trainings left in `folder` (a mode's outbox) to the current store (`uri`, else
    MLFLOW_TRACKING_URI or the default): the `send-runs` command. A kept model is built by the
    workload its run's params name in the store (`workload`, params.yaml's, where they name none). Where the calls go is the
    user's setting now, never what a file says; a line may only touch the runs the mode's
    mlflow_run.json names. Returns how many calls were sent (None: nothing was kept)."""
    from functools import partial

    from mlflow import MlflowClient

    from pipeline.atomic import read_json
    from pipeline.tracking.outbox import DeliveryFailed, replay

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
    # The workload the training named, as its run holds it in the store (params.yaml may have moved
    # on since, to another experiment's): the one a kept model may be built by.
    try:
        workload = MlflowClient(uri).get_run(ids["parent"]).data.params.get("workload.class_path") or workload
    except Exception:  # no such run: its lines are refused below, one by one
        pass
    sent = 0
    for path in kept:
        target = path.with_suffix(".target")
        made_for = shown(target.read_text(errors="replace").strip()) if target.is_file() else "(not recorded)"
        deliver = partial(_deliver, MlflowClient(uri), uri)
        try:
            sent += replay(path, deliver, op_checker(folder.parent, run_ids, registered, workload))
        except DeliveryFailed as failed:
            exc = failed.cause
            if http_status(exc) == 404 and type(exc).__module__.split(".")[0] not in ("boto3", "botocore", "s3transfer"):
                raise PipelineError(
                    f"{failed.where}: its run is not in the tracking store {shown(uri)} (these calls were made for "
                    f"{made_for}); set MLFLOW_TRACKING_URI to that store and run send-runs again, or drop what is "
                    f"kept with {discard}") from None
            if from_tracking(exc) and not refused(exc):
                with store_errors(uri, f"sending {failed.where}"):
                    raise exc from None
            raise PipelineError(f"{failed.where}: the tracking store {shown(uri)} refused it ({reason(exc)}); fix "
                                f"what it says and run send-runs again, or drop what is kept with {discard}") from None
    return sent
