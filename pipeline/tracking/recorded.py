"""A mode run's record, read back from the store, and a reproduction's verdict written onto it:
the MLflow side of `mnist-pipeline reproduce` (pipeline/reproduce.py)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class StoredRun:
    """What the store holds of one run: the parts a reproduction reads."""

    run_id: str
    name: str
    status: str
    tags: dict[str, str]
    params: dict[str, str]


class RunStore:
    """The tracking store at `uri`, for reading runs and tagging them."""

    def __init__(self, uri: str) -> None:
        from mlflow import MlflowClient

        self.uri = uri
        self._client = MlflowClient(uri)

    def run(self, run_id: str) -> StoredRun | None:
        """The run, or None where the store has no run by that id (or the id is not one)."""
        from mlflow.exceptions import MlflowException

        try:
            run = self._client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise
        return StoredRun(run_id, run.info.run_name, run.info.status, dict(run.data.tags), dict(run.data.params))

    def artifact_bytes(self, run_id: str, path: str) -> bytes:
        """One of the run's artifacts, as stored."""
        with tempfile.TemporaryDirectory() as tmp:
            return Path(self._client.download_artifacts(run_id, path, tmp)).read_bytes()

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._client.set_tag(run_id, key, value)
