"""What trains: a workload, named in params.yaml by import path, as LightningCLI names a class
(`class_path`, `init_args`) and torchtitan a `TrainSpec`.

    workload:
      class_path: pipeline.workloads.mnist.Mnist   # or the project's own: workloads.teamwork.Mlp
      init_args: {model: small, label_smoothing: 0.1}

A workload is a subclass of `Workload`, built with `init_args` as its keyword arguments, that gives
the pipeline what is particular to it:
- `build_model()`: the network, freshly initialised (the loop seeds torch first, alike in every mode);
- `loss(outputs, targets)`: the training loss of a batch, summed over its samples, not averaged. The
  loop divides by the global batch's length, so DDP's ranks, whatever their shares, add up to the
  one-device gradient: a loss that is a sum of per-sample terms keeps single = dp = ddp;
- `metrics(outputs, targets)`: named scores of a batch, each summed over its samples (MNIST: the
  correct answers, shown as "accuracy" once divided by the count), the same names for every batch,
  an empty one included; they are logged as `train_<name>` and `val_<name>`;
- `eval_loss(outputs, targets)`: the loss reported for validation, summed alike (by default `loss`);
- `example_batch()`: a small (inputs, targets) batch shaped as the data's, what the pipeline tries
  the workload on before anything on disk changes (and reads its metrics' names from).

And its data, MNIST's unless it gives its own:
- `prepare(out, raw, data)`: reads and verifies the raw inputs (fetched into `raw` if need be) and
  writes the train, val and test splits into `out`, with a `stats.json` that gives each split's
  count; the `prepare` stage moves `out` into place whole once it returns, so a failure leaves
  nothing half written;
- `split(data_dir, name)`: one split of what `prepare` wrote, as `Samples`: a map-style Dataset of
  (input, target), read whole onto the device (train.loader: memory) or by DataLoader workers
  (train.loader: dataloader), what each batch's inputs go through once on the device, and what
  each training sample goes through as a DataLoader worker reads it, every epoch anew (seeded
  by the pipeline per sample and epoch: augmentation that keeps the modes equal).

The optimizer and its schedule are params (train.optimizer, train.schedule), not the workload's.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import DataConfig, WorkloadConfig
from pipeline.errors import ConfigError
from pipeline.prepared import Samples, mnist_samples, prepare_mnist

__all__ = ["Samples", "Workload", "load_workload", "workload_of"]  # Samples: what `split` returns

# Where a class path recorded in a model file may point without the loader's say-so: a file read from
# an artifact store must not be able to import (and so run) whatever module it names.
PACKAGE = __name__ + "."
# Where a stage's workload may live: this package, or the project's own `workloads/` folder, which
# dvc.yaml lists as a dependency of the stages that import it and every run records with the code
# (pipeline.record.CODE_PACKAGES). A module anywhere else would change unseen by either.
PROJECT = "workloads."


class Workload:
    """The parts of a training that are the workload's. Subclass it and override each method;
    `prepare` and `split` give MNIST's data unless overridden."""

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def eval_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(outputs, targets)

    def example_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def prepare(self, out: Path, raw: Path, data: DataConfig) -> str:
        """Write the train, val and test splits and stats.json into `out`, an empty folder; return
        what they were made from, in a few words. MNIST's: its IDX files (MNIST_SOURCE, or a download
        into `raw`), their MD5s checked, val split off train by `data`."""
        return prepare_mnist(out, raw, data)

    def split(self, data_dir: Path, name: str) -> Samples:
        """Split `name` (train, val or test) of what `prepare` wrote into `data_dir`; a DataError
        naming the file where it is missing or is not what `prepare` wrote."""
        return mnist_samples(data_dir, name)


PARTS = ("build_model", "loss", "metrics", "example_batch")  # eval_loss has a default
DATA_PARTS = ("prepare", "split")  # MNIST's unless both are the workload's own
# Names the loop's own numbers take (val_loss, the count it divides by, train_time_s,
# train_loss_window): a metric of one of these names would be mixed up with them.
RESERVED = ("loss", "count", "time_s", "loss_window",
            # and compare's own numbers beside the test scores in metrics/<mode>.json (pipeline.report)
            "samples_per_s", "speedup", "scaling_efficiency", "step_ms", "train_time_s", "timing_warnings", "val_loss",
            "val_accuracy", *(f"{key}_{end}" for key in ("speedup", "scaling_efficiency", "step_ms") for end in ("low", "high")))


def load_workload(config: WorkloadConfig, source: str = "params.yaml") -> Workload:
    """The workload `config` names, built from its init_args; anything wrong with it is a
    ConfigError naming workload.class_path (or init_args) and what to do."""
    where = f"{source}: workload.class_path = {config.class_path!r}"
    cls = _import_class(config.class_path, where)
    if not (inspect.isclass(cls) and issubclass(cls, Workload)):
        raise ConfigError(f"{where} is {_kind(cls)}, not a subclass of pipeline.workloads.Workload; name a "
                          "class that subclasses it")
    missing = [part for part in PARTS if getattr(cls, part) is getattr(Workload, part)]
    if missing:
        raise ConfigError(f"{where} does not define {', '.join(missing)}; a workload gives each of "
                          f"{', '.join(PARTS)} (pipeline/workloads/__init__.py says what each returns)")
    own = [part for part in DATA_PARTS if getattr(cls, part) is not getattr(Workload, part)]
    if len(own) == 1:
        raise ConfigError(f"{where} defines {own[0]} but not {({*DATA_PARTS} - {*own}).pop()}: its data is both or "
                          "neither (MNIST's), as split reads what prepare writes")
    _bound(cls, config, source)
    try:
        return cls(**config.init_args)
    except Exception as exc:  # the class refused an argument's value
        raise ConfigError(f"{source}: workload.init_args = {config.init_args!r}: {cls.__name__} refused them "
                          f"({type(exc).__name__}: {exc})") from None


def _bound(cls: type, config: WorkloadConfig, source: str) -> inspect.BoundArguments:
    try:
        bound = inspect.signature(cls).bind(**config.init_args)
    except ValueError:  # no signature to read (a class built in C): the class itself says at its call
        return inspect.Signature().bind()
    except TypeError as exc:
        raise ConfigError(f"{source}: workload.init_args = {config.init_args!r} do not fit {cls.__name__}"
                          f"{inspect.signature(cls)} ({exc}); give it the arguments it takes (dvc exp run replaces "
                          "them whole with -S '~workload.init_args' -S '+workload.init_args={...}')") from None
    bound.apply_defaults()
    return bound


def full_init_args(config: WorkloadConfig) -> dict[str, Any]:
    """Every argument the workload is built with, its defaults filled in: `{model: small}` and
    `{model: small, label_smoothing: 0.1}` are the same training (a checkpoint's trajectory). A
    default that is not plain data (an enum, a class) as its repr: a checkpoint holds plain data."""
    cls = _import_class(config.class_path, f"workload.class_path = {config.class_path!r}")
    if not inspect.isclass(cls):
        return dict(config.init_args)
    return {name: value if name in config.init_args else _plain(value)
            for name, value in _bound(cls, config, "params.yaml").arguments.items()}


def _plain(value: Any) -> Any:
    try:
        return value if json.loads(json.dumps(value)) == value else repr(value)
    except (TypeError, ValueError):
        return repr(value)


def _import_class(class_path: str, where: str) -> Any:
    # A module of the project's own (a team's package) imports from the project root, which
    # `mnist-pipeline` puts first on sys.path, and on PYTHONPATH for every process it starts (stages/entry.py).
    module_name, _, name = class_path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name and not (module_name == exc.name or module_name.startswith(exc.name + ".")):  # one it imports
            raise ConfigError(f"{where}: importing {module_name} failed ({type(exc).__name__}: {exc}): install what "
                              "it imports") from None
        raise ConfigError(f"{where}: cannot import {module_name} ({exc}); check the path, or run from the project "
                          "root that holds the module (and, for `dvc exp run --temp` or --queue, commit it)") from None
    except Exception as exc:
        raise ConfigError(f"{where}: importing {module_name} failed ({type(exc).__name__}: {exc})") from None
    if not hasattr(module, name):
        raise ConfigError(f"{where}: {module_name} has no {name}; check the class's name")
    return getattr(module, name)


def _kind(thing: Any) -> str:
    return f"the class {thing.__name__}" if inspect.isclass(thing) else f"a {type(thing).__name__}"


def check_workload(workload: Workload, config: WorkloadConfig, source: str = "params.yaml") -> None:
    """Try the workload on its own example batch, as the loop will call it: a model that is an
    nn.Module and outputs a tensor, a loss that is a scalar with a gradient and a sum (twice the
    batch, twice the loss), metrics that are finite scalar sums under names of their own, the same
    for an empty batch (a DDP rank's share of a short last batch can be empty). What returns the
    wrong kind of thing is named here, before any stage changes anything on disk."""
    where = f"{source}: workload.class_path = {config.class_path!r}"

    def call(part: str, *args, on: str = "its example batch"):
        try:
            return getattr(workload, part)(*args)
        except Exception as exc:
            raise ConfigError(f"{where}: its {part}() failed on {on} ({type(exc).__name__}: {exc})") from None

    try:
        model = workload.build_model()
    except Exception as exc:  # most often an init_args value of the wrong kind
        raise ConfigError(f"{where}: its build_model() failed ({type(exc).__name__}: {exc}); check "
                          f"workload.init_args = {config.init_args!r}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{where}: build_model() returned {_kind(model)}, not a torch.nn.Module")
    batch = call("example_batch")
    if not (isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)
            and len(batch[0]) == len(batch[1]) > 0):
        raise ConfigError(f"{where}: example_batch() must return (inputs, targets), two tensors of the same "
                          "non-zero length")
    inputs, targets = batch
    model.eval()  # no dropout draws, no batch-norm statistics updated
    try:
        with torch.enable_grad():
            outputs = model(inputs)
    except Exception as exc:
        raise ConfigError(f"{where}: its model failed on example_batch()'s inputs ({type(exc).__name__}: "
                          f"{exc})") from None
    try:
        with torch.no_grad():
            empty = model(inputs[:0])
    except Exception as exc:
        raise ConfigError(f"{where}: its model failed on an empty batch ({type(exc).__name__}: {exc}), which a DDP "
                          "rank's share of a short last batch can be: reshape with torch.flatten(x, 1), not "
                          "x.view(len(x), -1)") from None
    for given in (outputs, empty):
        if not isinstance(given, torch.Tensor) or not given.is_floating_point():
            raise ConfigError(f"{where}: its model returned {_kind(given)}, not a floating-point tensor")
    outputs, empty = outputs.float(), empty.float()
    with torch.enable_grad():
        loss = _scalar(call("loss", outputs, targets), f"{where}: loss()")
    if not loss.requires_grad:
        raise ConfigError(f"{where}: loss() has no gradient to the model's weights (computed under no_grad, or "
                          "detached?)")
    with torch.no_grad():
        doubled = (torch.cat([outputs, outputs]), torch.cat([targets, targets]))
        empty_targets = targets[:0]
        for part in ("loss", "eval_loss"):
            once = _scalar(call(part, outputs, targets), f"{where}: {part}()")
            twice = _scalar(call(part, *doubled, on="its example batch twice over"), f"{where}: {part}()")
            _summed(once, twice, f"{where}: {part}()")
            nothing = _scalar(call(part, empty, empty_targets, on="an empty batch"), f"{where}: {part}() on an empty batch")
            if nothing.item() != 0.0:  # a rank with an empty share adds it to every other rank's sum
                raise ConfigError(
                    f"{where}: {part}() on an empty batch is {nothing.item():g}, not 0 (a sum over no samples); some "
                    "of torch's losses return uninitialised memory there with reduction='sum' (multi_margin_loss): "
                    "take reduction='none' and .sum() it")
        once = call("metrics", outputs, targets)
        names = _scores(once, where)
        twice = call("metrics", *doubled, on="its example batch twice over")
        if _scores(twice, where) != names:
            raise ConfigError(f"{where}: metrics() named {names} on the example batch and {sorted(twice)} on it "
                              "twice: name the same scores for every batch")
        for name in names:
            _summed(once[name], twice[name], f"{where}: metrics()[{name!r}]")
        none = call("metrics", empty, empty_targets, on="an empty batch")
        if _scores(none, f"{where} (on an empty batch)") != names:
            raise ConfigError(f"{where}: metrics() named {names} on the example batch and {sorted(none)} on an "
                              "empty batch: name the same scores for every batch")


def _scores(scores: Any, where: str) -> list[str]:
    if not isinstance(scores, dict):
        raise ConfigError(f"{where}: metrics() returned {_kind(scores)}, not a dict of name: summed score")
    for name, value in scores.items():
        if not (isinstance(name, str) and name.isidentifier()) or name in RESERVED:
            raise ConfigError(f"{where}: metrics() named a score {name!r}; names are identifiers other than "
                              f"{', '.join(RESERVED)} (logged as train_<name>, val_<name>)")
        _scalar(value, f"{where}: metrics()[{name!r}]")
    return sorted(scores)


def _summed(once: torch.Tensor, twice: torch.Tensor, what: str) -> None:
    """A sum over the samples doubles when every sample comes twice; a mean stays put."""
    if not torch.allclose(twice.double(), 2 * once.double(), rtol=1e-4, atol=1e-6):
        raise ConfigError(f"{what} gives {once.item():.6g} on the example batch and {twice.item():.6g} on it twice: "
                          "return the sum over the samples (reduction=\"sum\"), not their mean; the pipeline divides "
                          "by the global batch, so DDP's ranks add up to one device's gradient")


def _scalar(value: Any, what: str) -> torch.Tensor:
    if not (isinstance(value, torch.Tensor) and value.dim() == 0):
        kind = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else _kind(value)
        raise ConfigError(f"{what} returned {kind}, not a scalar tensor (a sum over the batch's samples)")
    if not math.isfinite(value.item()):
        raise ConfigError(f"{what} is {value.item()}, not a finite number")
    return value


def score_names(workload: Workload, model: nn.Module, device: torch.device) -> list[str]:
    """The names of the workload's metrics, in the order every rank sums them: read from its example
    batch through `model`, so that a rank with no sample to score (a validation split smaller than
    the world) still sends every one. In eval mode, without a gradient: the model draws nothing and
    changes no state (the loop asks once, before it seeds an epoch's draws)."""
    inputs, targets = workload.example_batch()
    was_training = model.training
    model.eval()
    with torch.no_grad():
        names = sorted(workload.metrics(model(inputs.to(device)).float(), targets.to(device)))
    model.train(was_training)
    return names


def default_workload() -> Workload:
    """The workload params.yaml names by default: MNIST, its small network."""
    return load_workload(WorkloadConfig())


def workload_of(config: WorkloadConfig, source: str = "params.yaml") -> Workload:
    """load_workload, then check_workload: the workload a stage starts with, from this package or
    the project's workloads/ folder."""
    module = config.class_path.rpartition(".")[0]
    outside = (f"{source}: workload.class_path = {config.class_path!r} is outside the project's workloads/ folder, "
               "which DVC reruns the stages for and every run records with the code: move "
               f"{module.replace('.', '/')}.py into workloads/ and name it workloads.{config.class_path}")
    if not config.class_path.startswith((PACKAGE, PROJECT)):
        raise ConfigError(outside)
    workload = load_workload(config, source)
    found = Path(inspect.getfile(type(workload))).resolve()
    if not any(found.is_relative_to(folder.resolve()) for folder in (Path(__file__).parent, project_workloads())):
        raise ConfigError(f"{outside.split(' is outside')[0]} was imported from {found}, not from the project's "
                          "workloads/ folder: make one (a workloads/__init__.py) and keep the module there")
    check_workload(workload, config, source)
    return workload


def project_workloads() -> Path:
    """The project's own workloads/ folder (pipeline.record.code_folders records it)."""
    from pipeline.record import project_folder

    return project_folder() / "workloads"


def saved_workload(saved: dict, path: Path, allow: str | None = None) -> Workload:
    """The workload a model file names (train records it), to build the network its weights fit.
    A file written before workloads were named holds only MNIST's model name. A class path outside
    this package is imported only when the caller names it in `allow` (the project's own params
    say so): a file from an artifact store cannot make its reader import a module of its choice."""
    recorded = saved.get("workload")
    if recorded is None and isinstance(saved.get("model"), str):  # an MNIST model file from before
        recorded = {"class_path": WorkloadConfig().class_path, "init_args": {"model": saved["model"]}}
    if not (isinstance(recorded, dict) and isinstance(recorded.get("class_path"), str)
            and isinstance(recorded.get("init_args"), dict)):
        raise ConfigError(f"{path}: its workload record {recorded!r} is not a class_path and init_args")
    config = WorkloadConfig(recorded["class_path"], recorded["init_args"])
    if not config.class_path.startswith(PACKAGE) and config.class_path != allow:
        raise ConfigError(f"{path}: trained by workload {config.class_path}, outside this package, which only the "
                          "project whose params.yaml names it builds (a model file must not choose what its reader "
                          "imports)")
    return load_workload(config, source=str(path))


def recorded(config: WorkloadConfig) -> dict[str, Any]:
    """What a model file records of its workload (saved_workload reads it back)."""
    return {"class_path": config.class_path, "init_args": dict(config.init_args)}
