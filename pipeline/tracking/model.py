"""The model a mode trained, as an MLflow model: logged (models-from-code, pipeline/tracking/
mlflow_model.py, the weights beside it) and loaded back without running anything from the store."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline import record
from pipeline.errors import ConfigError, PipelineError
from pipeline.tracking.facts import git_facts

log = logging.getLogger(__name__)


def log_model(client, uri: str, op: dict) -> None:
    """The model a mode saved, as an MLflow model on its parent run (and, opted in, registered):
    models-from-code (pipeline/mlflow_model.py) with the weights file beside it, so loading it
    never unpickles anything from the artifact store."""
    import mlflow
    import torch
    from mlflow.models import Model, infer_signature

    from pipeline.tracking import mlflow_model

    path = Path(op["file"])
    if not path.is_file():
        log.warning("%s: gone, so its MLflow model is not logged", path)
        return
    example = example_tensor(op)
    try:
        with torch.no_grad():  # op["workload"]: the class path params.yaml names (delivery.op_checker), never the file's
            output = mlflow_model.build_from_weights(str(path), allow=op.get("workload"))(example).numpy()
    except PipelineError:
        raise
    except Exception as exc:  # the model itself, before any call to the store: no wait on the store helps
        raise ConfigError(f"{path}: the model does not run on its input example "
                          f"({type(exc).__name__}: {exc}), so it is not logged") from exc
    example = example.numpy()
    mlflow.set_tracking_uri(uri)
    # Into the run's experiment, by run id: mlflow.start_run(run_id=...) would set the run
    # RUNNING, then FINISHED on the way out, whatever status the training ended it with.
    run = client.get_run(op["run"])
    mlflow.set_experiment(experiment_id=run.info.experiment_id)
    registered = op.get("registered")
    code = mlflow_model.__file__
    own = _own_workload(op.get("workload"))
    # The model's code is the project's as it is now: after an outage, send-runs may log it hours
    # later, from files edited since. A project workload's package then stays out of it.
    changed = _code_changed_since(run, own)
    if changed:
        own = {}
        log.warning("%s", changed)
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
            **own,
        )
    # The weights as logged, by content: what `mnist-pipeline reproduce` compares a re-made run's with.
    client.set_tag(op["run"], "weights_sha256", record.saved_weights_digest(path))
    if changed:
        client.set_tag(op["run"], "model_code", changed)
    if registered:  # the mode names its version: models:/<name>@<mode> is what that mode trained
        version = str(info.registered_model_version)
        client.set_registered_model_alias(registered, op["mode"], version)
        for key, value in {"mode": op["mode"], "run_id": op["run"], **git_facts()}.items():
            client.set_model_version_tag(registered, version, key, value)


# The input example's types a model op may name: a workload's inputs (token ids, say) keep theirs; any
# floating one is logged as float32, as the model's inputs are (older ops name none: float32).
EXAMPLE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


def example_tensor(op: dict):
    """The model op's input example as a tensor of its own type (integers and booleans kept)."""
    import torch

    dtype = getattr(torch, op.get("example_dtype", "float32"))
    return torch.tensor(op["example"], dtype=torch.float32 if dtype.is_floating_point else dtype)


def _code_changed_since(run, own: dict) -> str | None:
    """What a model logged now would not hold of the code that trained `run` (its code_sha256,
    recorded when the training started), or None: the same code."""
    trained, now = run.data.tags.get("code_sha256"), record.code_digest()
    if not trained or trained == now:
        return None
    said = f"run {run.info.run_id}: the project's code changed after its training (code_sha256 {trained[:12]} then, " \
           f"{now[:12]} now), so its MLflow model is logged "
    if own:
        return said + "without the workload's package, which is not what trained it: load the model in a checkout " \
                      "of the training's commit (`mnist-pipeline reproduce` re-makes it)"
    return said + "with this package's model code as it is now"


def _own_workload(class_path: str | None) -> dict:
    """For a workload of the project's own (workloads.*), its package logged with the model, and its
    class path in the model's config: `mlflow.pyfunc.load_model`, which runs the model's code, builds
    it anywhere, with the package installed and without the project. The package's: nothing."""
    import importlib

    from pipeline.workloads import PACKAGE

    if not class_path or class_path.startswith(PACKAGE):
        return {}
    top = class_path.split(".")[0]
    try:  # a folder with an __init__.py or without one (a namespace package): its __path__ either way
        package = Path(next(iter(importlib.import_module(top).__path__)))
    except (ImportError, AttributeError, StopIteration) as exc:
        raise PipelineError(f"workload.class_path = {class_path!r}: {top} is not a package whose folder can go "
                            f"with the MLflow model ({type(exc).__name__}: {exc})") from None
    return {"code_paths": [str(package)], "model_config": {"workload": class_path}}


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


def load_model(model_uri: str, allow: str | None = None):
    """The network a mode logged (`runs:/ID/model`, `models:/NAME@ddp`), built by this package's
    code (or by `allow`, the project's own workload class that params.yaml names, imported from the
    project) from the logged weights alone: nothing from the artifact store is run or unpickled, so
    whoever can write to the store cannot run code on whoever loads the model."""
    import tempfile

    from pipeline.tracking.mlflow_model import build_from_weights

    with tempfile.TemporaryDirectory() as tmp:
        return build_from_weights(str(download_weights(model_uri, Path(tmp))), allow=allow)


def download_weights(model_uri: str, folder: Path, uri: str | None = None) -> Path:
    """The weights file (a mode's model.pt) of a logged model, downloaded into `folder` from the
    store at `uri` (None: MLflow's own setting, MLFLOW_TRACKING_URI)."""
    import mlflow
    import yaml

    from pipeline.tracking.mlflow_model import WEIGHTS

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(folder),
                                                     tracking_uri=uri, registry_uri=uri))
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    weights = (local / flavor["artifacts"][WEIGHTS]["path"]).resolve()
    if not weights.is_relative_to(local.resolve()):
        raise PipelineError(f"{model_uri}: its MLmodel points outside the model ({weights}); not loaded")
    return weights
