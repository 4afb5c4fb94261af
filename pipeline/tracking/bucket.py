"""Artifacts that every rank writes to a bucket itself: the check, made before training, that it
can (pipeline.tracking.store classifies what a bucket answers later: a refusal, or an outage)."""

from __future__ import annotations

import os
import urllib.parse
from typing import TYPE_CHECKING

from pipeline.config import TrackingConfig
from pipeline.errors import PipelineError
from pipeline.tracking.store import (HEALTH_TIMEOUT_S, bucket_error_code, bucket_status, is_local_file, reason,
                                     shown, store_errors, tracking_uri)

if TYPE_CHECKING:  # pipeline.parallel imports torch
    from pipeline.parallel import Rank


_checked: set[str] = set()  # locations this process has written to: single's worker is the command's process


def check_experiment(experiment_id: str) -> None:
    """After preflight: the artifact location of the experiment a training logs to."""
    from mlflow import MlflowClient

    uri = tracking_uri()
    with store_errors(uri, f"opening experiment {experiment_id}"):
        location = MlflowClient(uri).get_experiment(experiment_id).artifact_location
    check_artifact_location(location)


def check_artifact_location(location: str) -> None:
    """Where a server hands its artifacts to the clients to write themselves (`mlflow server
    --no-serve-artifacts --default-artifact-root s3://BUCKET/PATH`), every rank writes to the bucket
    with its own credentials. A missing or refused credential, an endpoint that does not answer or
    a bucket that is not there is found here, before training, not as an outage once it is over:
    a small object is written where the runs' files go, and removed. (A server that serves its
    artifacts, mlflow-artifacts:/, writes them with its own.)"""
    if not location.startswith("s3://") or location in _checked:
        return
    import boto3
    import botocore.exceptions

    parsed = urllib.parse.urlparse(location)
    bucket, key = parsed.netloc, f"{parsed.path.strip('/')}/.mnist-pipeline-write-check".lstrip("/")
    where = f"the experiment's artifact location {location}"
    endpoint = os.environ.get("MLFLOW_S3_ENDPOINT_URL") or None
    try:
        client = boto3.client("s3", **_as_mlflow_does(endpoint))
        at = shown(client.meta.endpoint_url)
        client.put_object(Bucket=bucket, Key=key, Body=b"")
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
            botocore.exceptions.ProfileNotFound) as exc:
        raise PipelineError(
            f"{where}: every rank writes there itself, and this one has no usable S3 credentials ({reason(exc)}); "
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE and its ~/.aws/credentials) where every "
            "rank runs") from None
    except botocore.exceptions.ClientError as exc:
        status, code = bucket_status(exc), bucket_error_code(exc)
        if code == "NoSuchBucket":
            raise PipelineError(f"{where}: bucket {bucket!r} does not exist at {at}; create it, or start the "
                                "tracking server with an existing one") from None
        if status in (401, 403):
            raise PipelineError(
                f"{where}: {at} does not let this client write there ({code}, HTTP {status}); set AWS_ACCESS_KEY_ID "
                "and AWS_SECRET_ACCESS_KEY to a key that may write under that prefix") from None
        raise PipelineError(f"{where}: {at} answered {reason(exc)}; fix the bucket or the server") from None
    except ValueError as exc:  # an endpoint that is no URL (no scheme)
        raise PipelineError(f"{where}: MLFLOW_S3_ENDPOINT_URL={shown(endpoint or '')} is not usable ({reason(exc)}); "
                            "set it to the server's URL, e.g. http://minio.internal:9000") from None
    except botocore.exceptions.BotoCoreError as exc:  # no connection, a timeout, a TLS failure
        raise PipelineError(f"{where}: cannot reach {shown(endpoint or 'S3')} ({reason(exc)}); start it, or fix "
                            "MLFLOW_S3_ENDPOINT_URL (and MLFLOW_S3_IGNORE_TLS for a self-signed certificate)") from None
    _checked.add(location)
    try:
        client.delete_object(Bucket=bucket, Key=key)
    except botocore.exceptions.ClientError:
        pass  # a key that may write but not delete: the check's empty object stays, and training may go on


def _as_mlflow_does(endpoint: str | None) -> dict:
    """boto3.client's settings as MLflow's S3 artifact repository makes them (its TLS, signature
    and addressing settings), with short timeouts: a check waits seconds, not minutes."""
    from botocore.config import Config

    ignore_tls = os.environ.get("MLFLOW_S3_IGNORE_TLS", "").lower() in ("true", "1")
    style = os.environ.get("MLFLOW_BOTO_CLIENT_ADDRESSING_STYLE") or "auto"
    signature = os.environ.get("MLFLOW_EXPERIMENTAL_S3_SIGNATURE_VERSION", "s3v4")
    return {"endpoint_url": endpoint, "verify": False if ignore_tls else None,
            "config": Config(signature_version=signature, s3={"addressing_style": style},
                             connect_timeout=HEALTH_TIMEOUT_S, read_timeout=HEALTH_TIMEOUT_S,
                             retries={"max_attempts": 2})}


def check_node_artifacts(rank: Rank, config: TrackingConfig) -> None:
    """preflight's artifact check, in each node's first worker: a training started where no
    `train` command ran it first (torchrun by hand, the TrainJob, a Slurm job) writes the bucket
    with each node's own credentials. An experiment not made yet is checked by whoever makes it."""
    uri = tracking_uri()
    if rank.local_rank != 0 or is_local_file(uri):  # a store that is a file keeps its artifacts beside it
        return
    from mlflow import MlflowClient

    with store_errors(uri, f"opening experiment {config.experiment!r}"):
        experiment = MlflowClient(uri).get_experiment_by_name(config.experiment)
    if experiment is not None:
        check_artifact_location(experiment.artifact_location)
