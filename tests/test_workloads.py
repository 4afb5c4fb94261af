"""A workload named in params.yaml (pipeline.workloads): refused at start when it cannot work, MNIST's
own calls kept, and a team's own workload, in a module of the project outside the package, trained
by the stages in every mode."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from pipeline import record
from pipeline.checkpoint import settings_changed, trajectory
from pipeline.config import TrainConfig, WorkloadConfig, config_from_dict, flatten
from pipeline.errors import ConfigError, PipelineError
from pipeline.loop import add_scores, zero_scores
from pipeline.tracking.delivery import op_checker
from pipeline.workloads import check_workload, full_init_args, load_workload, saved_workload, workload_of
from pipeline.workloads.mnist import Mnist
from tests.conftest import SMALL, load_weights, make_project, prepare, project_env, relative_difference, run, train_cli
from tests.ddp_harness import learnable_data, run_ranks, train_config, train_each

# A team's workload: an MLP over the same images, a margin loss and a top-2 score. Per-sample terms,
# so its DDP training is its single training, to rounding.
TEAM = '''
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.workloads import Workload


class Mlp(Workload):
    def __init__(self, hidden: int = 32):
        self.hidden = hidden

    def build_model(self):
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 10))

    def loss(self, outputs, targets):
        return F.multi_margin_loss(outputs, targets, reduction="sum")

    def metrics(self, outputs, targets):
        top2 = outputs.topk(2, dim=1).indices
        return {"accuracy": (top2[:, 0] == targets).sum(), "top2": (top2 == targets[:, None]).any(1).sum()}

    def example_batch(self):
        return torch.zeros(2, 1, 28, 28), torch.tensor([3, 4])
'''

# Broken workloads, one fault each, beside a sound one.
BROKEN = TEAM + '''

class NoLoss(Workload):
    def build_model(self):
        return nn.Linear(2, 2)

    def metrics(self, outputs, targets):
        return {}

    def example_batch(self):
        return torch.zeros(2, 2), torch.tensor([0, 1])


class NotAModule(Mlp):
    def build_model(self):
        return "a model"


class PerSampleLoss(Mlp):
    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets, reduction="none")


class ListMetrics(Mlp):
    def metrics(self, outputs, targets):
        return [1.0]


class NamedLoss(Mlp):
    def metrics(self, outputs, targets):
        return {"loss": outputs.sum()}


class WrongShape(Mlp):
    def example_batch(self):
        return torch.zeros(2, 3, 5, 5), torch.tensor([0, 1])


class MeanLoss(Mlp):
    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets)


class Detached(Mlp):
    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets, reduction="sum").detach()


class Counted(Mlp):
    def metrics(self, outputs, targets):
        return {"count": torch.tensor(float(len(targets)))}


class PresentOnly(Mlp):
    def metrics(self, outputs, targets):  # a score per class seen: other names on other batches
        return {f"class_{int(c)}": (outputs.argmax(1) == c).sum() for c in targets.unique()}


class MeanScore(Mlp):
    def metrics(self, outputs, targets):
        return {"answered": (outputs.argmax(1) >= 0).float().mean()}  # 1 on any batch, not the count


class Plain:
    pass


raise_on_import = False
'''


@pytest.fixture
def team_module(tmp_path, monkeypatch):
    (tmp_path / "teamwork.py").write_text(textwrap.dedent(BROKEN))
    (tmp_path / "exploding.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "needy.py").write_text("import a_package_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def refusal(class_path: str, **init_args) -> str:
    """What workload_of says of the class, wherever it is (workload_of also wants it in workloads/)."""
    config = WorkloadConfig(class_path, init_args)
    with pytest.raises(ConfigError) as caught:
        check_workload(load_workload(config), config)
    message = str(caught.value)
    assert "\n" not in message and "workload." in message
    return message


@pytest.mark.fast
def test_a_workload_that_cannot_work_is_refused_in_one_line_naming_what_is_wrong(team_module):
    assert "cannot import nowhere" in refusal("nowhere.Mlp")
    assert "importing needy failed (ModuleNotFoundError: No module named 'a_package_not_installed'): install" \
        in refusal("needy.Mlp")
    assert "RuntimeError: no GPU here" in refusal("exploding.Mlp")
    assert "teamwork has no Missing" in refusal("teamwork.Missing")
    assert "is the class Plain, not a subclass of pipeline.workloads.Workload" in refusal("teamwork.Plain")
    assert "is a bool, not a subclass" in refusal("teamwork.raise_on_import")
    assert "does not define loss" in refusal("teamwork.NoLoss")
    assert "do not fit Mlp(hidden: int = 32)" in refusal("teamwork.Mlp", width=3)
    assert "build_model() returned a str, not a torch.nn.Module" in refusal("teamwork.NotAModule")
    assert "loss() returned a tensor of shape (2,), not a scalar tensor" in refusal("teamwork.PerSampleLoss")
    assert "metrics() returned a list, not a dict" in refusal("teamwork.ListMetrics")
    assert "metrics() named a score 'loss'" in refusal("teamwork.NamedLoss")
    assert "its model failed on example_batch()'s inputs" in refusal("teamwork.WrongShape")
    assert "return the sum over the samples (reduction=\"sum\"), not their mean" in refusal("teamwork.MeanLoss")
    assert "loss() has no gradient to the model's weights" in refusal("teamwork.Detached")
    assert "metrics() named a score 'count'" in refusal("teamwork.Counted")
    assert "name the same scores for every batch" in refusal("teamwork.PresentOnly")
    assert "metrics()['answered'] gives 1 on the example batch and 1 on it twice" in refusal("teamwork.MeanScore")
    assert "Mnist refused them (ValueError: model = 'resnet'" in refusal("pipeline.workloads.mnist.Mnist",
                                                                       model="resnet")
    assert "label_smoothing = 1.0" in refusal("pipeline.workloads.mnist.Mnist", label_smoothing=1.0)
    assert "its build_model() failed (TypeError: " in refusal("teamwork.Mlp", hidden="64")
    check_workload(load_workload(WorkloadConfig("teamwork.Mlp", {"hidden": 8})), WorkloadConfig("teamwork.Mlp"))
    # A stage's workload lives where DVC and the runs' record see its changes.
    with pytest.raises(ConfigError, match=r"outside the project's workloads/ folder, .*: move teamwork.py into "
                                          r"workloads/ and name it workloads.teamwork.Mlp"):
        workload_of(WorkloadConfig("teamwork.Mlp", {"hidden": 8}))


@pytest.mark.fast
def test_mnist_is_the_default_workload_and_makes_the_calls_the_loop_made_before():
    """The default params name MNIST's small network with label smoothing 0.1, and its parts are
    the cross-entropy calls that were the loop's own (what keeps the weights bit for bit; the
    `dvc repro` digests say the same of the whole pipeline)."""
    config = config_from_dict(yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text()))
    assert config.workload.class_path == WorkloadConfig().class_path
    assert full_init_args(config.workload) == full_init_args(WorkloadConfig()) == {"model": "small",
                                                                                   "label_smoothing": 0.1}
    assert flatten(config)["workload.init_args.model"] == "small"
    mnist = workload_of(config.workload)
    assert isinstance(mnist, Mnist) and (mnist.model, mnist.label_smoothing) == ("small", 0.1)
    outputs, targets = torch.randn(64, 10, generator=torch.Generator().manual_seed(0)), torch.arange(64) % 10
    assert torch.equal(mnist.loss(outputs, targets),
                       F.cross_entropy(outputs, targets, label_smoothing=0.1, reduction="sum"))
    assert torch.equal(mnist.eval_loss(outputs, targets), F.cross_entropy(outputs, targets, reduction="sum"))
    assert mnist.metrics(outputs, targets)["accuracy"] == (outputs.argmax(1) == targets).sum()


@pytest.mark.fast
def test_a_checkpoint_resumes_only_under_its_own_workload_and_reads_those_from_before():
    train = TrainConfig()
    mine = trajectory(train, "single", WorkloadConfig())
    # The same training whether params spell out the defaults or not.
    assert mine == trajectory(train, "single", WorkloadConfig(init_args={"label_smoothing": 0.1}))
    classic = trajectory(train, "single", WorkloadConfig(init_args={"model": "classic", "label_smoothing": 0.1}))
    assert "workload" in settings_changed({"trajectory": mine}, classic)
    # A checkpoint written before workloads were named: MNIST's model and label smoothing were train's.
    before = {key: value for key, value in mine.items() if key != "workload"}
    before.update(model="small", label_smoothing=0.1)
    assert settings_changed({"trajectory": before}, mine) == ""
    assert "workload" in settings_changed({"trajectory": {**before, "label_smoothing": 0.0}}, mine)


@pytest.mark.fast
def test_a_model_file_builds_only_a_workload_its_reader_allows(team_module, tmp_path):
    path = tmp_path / "model.pt"
    ours = {"workload": {"class_path": "teamwork.Mlp", "init_args": {"hidden": 8}}}
    with pytest.raises(ConfigError, match="outside this package, which only the project whose params.yaml names it builds"):
        saved_workload(ours, path)  # a file from a store must not choose what its reader imports
    assert saved_workload(ours, path, allow="teamwork.Mlp").hidden == 8
    assert saved_workload({"model": "classic"}, path).model == "classic"  # a file from before workloads
    with pytest.raises(ConfigError, match="is not a class_path and init_args"):
        saved_workload({"state_dict": {}}, path)
    # An outbox line (on a disk others may write to) may not name the workload that builds its model.
    (tmp_path / "single").mkdir()
    check = op_checker(tmp_path / "single", ["a" * 32], workload="teamwork.Mlp")
    line = {"op": "model", "run": "a" * 32, "file": str(tmp_path / "single" / "model.pt"), "mode": "single",
            "example": []}
    check({**line, "workload": "teamwork.Mlp"})
    with pytest.raises(ValueError, match="workload.class_path says 'teamwork.Mlp'"):
        check({**line, "workload": "models.single.evil.X"})


@pytest.mark.fast
def test_every_batch_sums_the_scores_the_example_batch_named():
    sums = zero_scores(["accuracy"], torch.device("cpu"))
    add_scores(sums, {"accuracy": torch.tensor(3)})
    assert sums["accuracy"].item() == 3 and sums["accuracy"].dtype == torch.float64
    with pytest.raises(PipelineError, match=r"named \['class_1'\] on a batch and \['accuracy'\] on its example"):
        add_scores(sums, {"class_1": torch.tensor(1)})


def test_a_rank_with_no_validation_sample_still_sends_every_metric(tmp_path):
    """One validation sample at two ranks: rank 1 scores nothing, yet its epoch's all_reduce carries
    the same sums as rank 0's (their names come from the example batch, not from the batches seen)."""
    run_ranks(2, train_each, [train_config(batch_size=16)], learnable_data(64), learnable_data(1, seed=1), tmp_path)
    epoch = torch.load(tmp_path / "0.pt", weights_only=False)["history"][0]
    assert epoch["val_accuracy"] in (0.0, 1.0) and math.isfinite(epoch["val_loss"])


def test_a_teams_workload_outside_the_package_trains_in_every_mode_and_is_evaluated(tmp_path, mnist_dir):
    """The stages, as a team runs them: its module in the project's workloads/ folder, named in
    params.yaml, imported by the stage and by DDP's ranks under torchrun. Its metrics are in the
    history, the model file names it, the runs' code record holds it, evaluate builds the model from
    it; single and ddp agree to rounding. A broken name is refused before the last training's files
    are touched."""
    params = {**SMALL, "workload": {"class_path": "workloads.teamwork.Mlp", "init_args": {"hidden": 24}}}
    project = make_project(tmp_path / "proj", params)
    (project / "workloads/teamwork.py").write_text(textwrap.dedent(TEAM))
    prepare(project, mnist_dir)
    for mode in ("single", "ddp"):  # the installed package, not PYTHONPATH: the stage finds the module itself
        run(["mnist-pipeline", "train", "--mode", mode], project)
    single, ddp = load_weights(project, "single"), load_weights(project, "ddp")
    assert single["1.weight"].shape == (24, 28 * 28)
    assert relative_difference(single, ddp) < 1e-3
    summary = yaml.safe_load((project / "results/train/ddp.json").read_text())
    assert 0 < summary["val_top2"] <= 1 and summary["val_accuracy"] <= summary["val_top2"]
    assert "train_top2" in (project / "plots/train/single.csv").read_text().splitlines()[0].split(",")
    saved = torch.load(project / "models/single/model.pt", weights_only=True)
    assert saved["workload"] == params["workload"]
    # Its MLflow model logged (the weights' digest is set once it is), with the workload's metrics.
    import mlflow  # here: the fast tests above do without its import

    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    parent = client.get_run(json.loads((project / "models/ddp/mlflow_run.json").read_text())["parent"])
    assert parent.data.tags["weights_sha256"] == record.saved_weights_digest(project / "models/ddp/model.pt")
    code = record.code_digest(record.code_folders_in(project))
    assert parent.data.tags["code_sha256"] == code != record.code_digest([project / "pipeline", project / "stages"])
    assert {"train_top2", "val_top2"} <= parent.data.metrics.keys()
    run(["mnist-pipeline", "evaluate", "--mode", "single"], project, **project_env(project))
    assert yaml.safe_load((project / "results/eval/single.json").read_text())["accuracy"] > 0.5

    def kept() -> dict:  # the training's files (the stage's lock file says who last held it)
        return {path: path.read_bytes() for path in (project / "models/single").rglob("*")
                if path.is_file() and path.name != ".train.lock"}

    before = kept()
    text = (project / "params.yaml").read_text()
    (project / "params.yaml").write_text(text.replace("teamwork.Mlp", "teamwork.Mpl"))
    refused = train_cli(project, "single", check=False)
    assert refused.returncode != 0
    assert "workload.class_path = 'workloads.teamwork.Mpl': workloads.teamwork has no Mpl" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert kept() == before
