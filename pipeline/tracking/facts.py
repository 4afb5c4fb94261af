"""What a run records about where it ran: the commit and its uncommitted change, the DVC
experiment, and the prepared splits it read as MLflow datasets."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Iterable

from pipeline import record


def dvc_experiment_facts() -> dict[str, str]:
    """The DVC experiment a run belongs to (set by `dvc exp run`), so a row of `dvc exp show` and
    its MLflow runs find each other."""
    facts = {"dvc_experiment": os.environ.get("DVC_EXP_NAME"),
             "dvc_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV")}
    return {key: value for key, value in facts.items() if value}


def run_name(name: str) -> str:
    """A run's name, after its DVC experiment's under `dvc exp run` (`lr-high/single`), so that the
    runs page sorts, and searches (`attributes.run_name LIKE 'lr-high/%'`), a sweep's runs by
    experiment; plain in the workspace's own `dvc repro`."""
    experiment = os.environ.get("DVC_EXP_NAME")
    return f"{experiment}/{name}" if experiment else name


def git_facts() -> dict[str, str]:
    commit = record.git("rev-parse", "HEAD").strip()
    # As the patch sees it (pipeline.record.PATCH_COMMAND): bytes, line ends included, and submodules.
    dirty = record.git(*record.BYTE_EXACT_GIT, "status", "--porcelain", "--untracked-files=no",
                       "--ignore-submodules=none").strip()
    return {"git_commit": commit or "unknown", "git_dirty": str(bool(dirty)).lower() if commit else "unknown"}


def log_uncommitted_change(client, parent_id: str) -> None:
    """A dirty tree's change, on the parent run, so that the run can still be re-made from its
    record (`mnist-pipeline reproduce`); the tag says where it is."""
    import tempfile

    patch = record.uncommitted_patch()
    record.check_code_as_imported()  # the patch, too, is of the code this training imported
    if patch:
        with tempfile.TemporaryDirectory() as folder:  # bytes as git wrote them: no text round trip
            path = Path(folder) / record.PATCH_FILE
            path.write_bytes(patch)
            client.log_artifact(parent_id, str(path), record.PATCH_FOLDER)
        client.set_tag(parent_id, "git_patch", record.PATCH_ARTIFACT)


def _file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# A unique key broken by a row that another client inserted meanwhile (PostgreSQL, SQLite, MySQL).
_RACED = re.compile(r"UniqueViolation|UNIQUE constraint failed|Duplicate entry|duplicate key value")


def log_datasets(client, run_id: str, data_dir: Path, splits: Iterable[str]) -> None:
    """The splits a run read, on it. MLflow's SQL store looks a dataset up, then inserts it: two
    trainings that log the same one at once (a sweep's tasks on one server) break its unique key
    in the slower one's insert. Tried again, that one finds the dataset and inserts none."""
    inputs = dataset_inputs(data_dir, splits)
    for attempt in range(3):
        try:
            return client.log_inputs(run_id, datasets=inputs)
        except Exception as exc:
            if attempt == 2 or not _RACED.search(str(exc)):
                raise
            time.sleep(0.2 * (attempt + 1))


def dataset_inputs(data_dir: Path, splits: Iterable[str]) -> list:
    """The prepared splits a run read, as MLflow datasets (the UI's Dataset column): the file, its
    digest, and the MNIST files it came from with the MD5s the prepare stage verified."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    from pipeline.prepared import load_stats

    stats = load_stats(data_dir)
    inputs = []
    for split in splits:
        path = Path(data_dir) / f"{split}.pt"
        described = stats["splits"][split]
        if "sources" in stats and "class_counts" in described:  # MNIST's
            origin = "t10k-" if split == "test" else "train-"  # val is carved out of MNIST's training files
            name = f"mnist-{split}"
            profile = {"images": described["count"], "class_counts": described["class_counts"],
                       "mnist_files_md5": {name: f["md5"] for name, f in stats["sources"].items()
                                           if name.startswith(origin)},
                       "checksums_verified": stats["checksums_verified"]}
        else:  # another workload's: what its stats.json says of the split
            name = split
            profile = {key: value for key, value in described.items() if isinstance(value, (int, float, str, bool))}
        # The split's file where it is one (MNIST's), else the prepared folder's stats.json, which describes it.
        digest = _file_md5(path if path.is_file() else Path(data_dir) / "stats.json")[:10]
        dataset = Dataset(name=name, digest=digest, source_type="local",
                          source=json.dumps({"uri": str(path if path.is_file() else data_dir)}), profile=json.dumps(profile))
        inputs.append(DatasetInput(dataset, [InputTag("mlflow.data.context", split)]))
    return inputs
