"""A workload named in params.yaml (pipeline.workloads): refused at start when it cannot work, MNIST's
own calls kept, and a team's own workload, in a module of the project outside the package, trained
by the stages in every mode."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from pipeline import record
from pipeline.checkpoint import settings_changed, trajectory
from pipeline.config import TrainConfig, WorkloadConfig, config_from_dict, flatten
from pipeline.errors import ConfigError, PipelineError
from pipeline.loop import add_scores, zero_scores
from pipeline.tracking.delivery import op_checker
from pipeline.workloads import Workload, check_workload, full_init_args, load_workload, saved_workload, workload_of
from pipeline.workloads.mnist import Mnist
from tests.conftest import (ROOT, SMALL, TABLE, add_table_workload, code_at, commit, load_weights, make_project,
                            prepare, project_env, relative_difference, run, train_cli)
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
        return F.multi_margin_loss(outputs, targets, reduction="none").sum()  # "sum" is garbage on an empty batch

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


class NonzeroOnNothing(Mlp):
    def loss(self, outputs, targets):  # what a garbage sum on an empty batch looks like, made certain
        return F.cross_entropy(outputs, targets, reduction="sum") + (1.5 if len(targets) == 0 else 0.0)


class Counted(Mlp):
    def metrics(self, outputs, targets):
        return {"count": torch.tensor(float(len(targets)))}


class Fast(Mlp):
    def metrics(self, outputs, targets):
        return {"speedup": (outputs.argmax(1) == targets).sum()}


class PresentOnly(Mlp):
    def metrics(self, outputs, targets):  # a score per class seen: other names on other batches
        return {f"class_{int(c)}": (outputs.argmax(1) == c).sum() for c in targets.unique()}


class MeanScore(Mlp):
    def metrics(self, outputs, targets):
        return {"answered": (outputs.argmax(1) >= 0).float().mean()}  # 1 on any batch, not the count


class HalfData(Mlp):
    def split(self, data_dir, name):  # its own split of MNIST's prepare: what would it read?
        raise NotImplementedError


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
    assert "defines split but not prepare: its data is both or neither" in refusal("teamwork.HalfData")
    assert "do not fit Mlp(hidden: int = 32)" in refusal("teamwork.Mlp", width=3)
    assert "build_model() returned a str, not a torch.nn.Module" in refusal("teamwork.NotAModule")
    assert "loss() returned a tensor of shape (2,), not a scalar tensor" in refusal("teamwork.PerSampleLoss")
    assert "metrics() returned a list, not a dict" in refusal("teamwork.ListMetrics")
    assert "metrics() named a score 'loss'" in refusal("teamwork.NamedLoss")
    assert "its model failed on example_batch()'s inputs" in refusal("teamwork.WrongShape")
    assert "return the sum over the samples (reduction=\"sum\"), not their mean" in refusal("teamwork.MeanLoss")
    assert "loss() has no gradient to the model's weights" in refusal("teamwork.Detached")
    assert "loss() on an empty batch is 1.5, not 0 (a sum over no samples)" in refusal("teamwork.NonzeroOnNothing")
    assert "metrics() named a score 'count'" in refusal("teamwork.Counted")
    assert "metrics() named a score 'speedup'" in refusal("teamwork.Fast")  # compare's, in metrics/<mode>.json
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


# In a folder with no project: mlflow.pyfunc.load_model, then a prediction, as JSON.
LOAD_ELSEWHERE = """
import json, sys
import mlflow, torch
model = mlflow.pyfunc.load_model(sys.argv[1])
assert not __import__("pathlib").Path("workloads").exists()
print(json.dumps(model.predict(torch.linspace(-1, 1, 2 * 28 * 28).reshape(2, 1, 28, 28).numpy()).tolist()))
"""
# In the project: pipeline.tracking.model.load_model, told the class its params name.
LOAD_IN_PROJECT = """
import json, sys
import torch
from pipeline.tracking.model import load_model
model = load_model(sys.argv[1], allow="workloads.teamwork.Mlp")
with torch.no_grad():
    print(json.dumps(model(torch.linspace(-1, 1, 2 * 28 * 28).reshape(2, 1, 28, 28)).tolist()))
"""


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
    # The logged model brings its workload's code: MLflow's loader builds it outside the project,
    # and predicts what the project's own code does; ours, which runs nothing from the store, is
    # told which class the project's params name.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = {"MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}"}
    model_uri = f"runs:/{parent.info.run_id}/model"
    loaded = run([sys.executable, "-c", LOAD_ELSEWHERE, model_uri], elsewhere, **store).stdout
    ours = run([sys.executable, "-c", LOAD_IN_PROJECT, model_uri], project, **project_env(project, **store)).stdout
    assert torch.allclose(torch.tensor(json.loads(loaded)), torch.tensor(json.loads(ours))), (loaded, ours)
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


# A workload whose inputs are integers: each image's pixels, every 16th, as token ids (0: dark, 1:
# lit), through an nn.Embedding. MNIST's own files and split, mapped once on the device.
TOKENS = '''
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.workloads import Samples, Workload


class Tokens(Workload):
    def build_model(self):
        return nn.Sequential(nn.Embedding(2, 4), nn.Flatten(), nn.Linear(49 * 4, 10))

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets, reduction="sum")

    def metrics(self, outputs, targets):
        return {"accuracy": (outputs.argmax(1) == targets).sum()}

    def example_batch(self):
        return torch.zeros(2, 49, dtype=torch.long), torch.tensor([3, 4])

    def prepare(self, out, raw, data):
        return super().prepare(out, raw, data)

    def split(self, data_dir, name):
        images = super().split(data_dir, name)
        return Samples(images.dataset, on_device=lambda inputs: tokens(images.on_device(inputs)))


def tokens(images):
    return (images > 0).long().flatten(1)[:, ::16]
'''
PREDICT_TOKENS = """
import json, sys
import mlflow, numpy
model = mlflow.pyfunc.load_model(sys.argv[1])
schema = model.metadata.get_input_schema().inputs[0]
print(json.dumps([str(schema.type), model.predict(numpy.ones((3, 49), dtype=numpy.int64)).tolist()]))
"""


def test_a_workload_of_token_ids_logs_a_model_that_takes_integers(tmp_path, mnist_dir):
    """Inputs that are integers (a text model's token ids) reach the logged MLflow model as they
    are: its input example and signature are int64, and the model MLflow loads predicts on them
    (an example cast to float32 once failed the Embedding, and the logging waited on it as if the
    store were away)."""
    project = make_project(tmp_path / "proj", {**SMALL, "workload": {"class_path": "workloads.text.Tokens",
                                                                     "init_args": {}}})
    (project / "workloads/text.py").write_text(textwrap.dedent(TOKENS))
    prepare(project, mnist_dir)
    said = train_cli(project, "single")
    assert "not logged" not in said.stderr, said.stderr
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    parent = json.loads((project / "models/single/mlflow_run.json").read_text())["parent"]
    assert client.get_run(parent).data.tags["weights_sha256"] == record.saved_weights_digest(
        project / "models/single/model.pt")  # set once the model is logged
    store = {"MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}"}
    printed = run([sys.executable, "-c", PREDICT_TOKENS, f"runs:/{parent}/model"], tmp_path, **store).stdout
    kind, predicted = json.loads(printed.splitlines()[-1])
    assert kind in ("int64", "long") and torch.tensor(predicted).shape == (3, 10), printed


def test_a_model_sent_after_its_workload_was_edited_leaves_the_package_out_and_says_so(tmp_path):
    """An outage kept the model's call, and the team edited its workload before `send-runs` sent
    it: the package as it is now is not what trained, so the MLflow model goes without it, and the
    command and the run say why. (Unedited, the model brings it: the test above.)"""
    import mlflow

    from pipeline.atomic import save_torch

    class_path = "workloads.teamwork.Mlp"
    project = make_project(tmp_path / "proj", {"workload": {"class_path": class_path, "init_args": {"hidden": 8}}})
    source = project / "workloads/teamwork.py"
    source.write_text(textwrap.dedent(TEAM))
    mode_dir, store = project / "models/single", f"sqlite:///{tmp_path / 'mlflow.db'}"
    outbox = mode_dir / "tracking-outbox"
    outbox.mkdir(parents=True)
    network = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, 10))  # Mlp(hidden=8)'s
    save_torch(mode_dir / "model.pt", {"state_dict": network.state_dict(),
                                       "workload": {"class_path": class_path, "init_args": {"hidden": 8}}})
    client = mlflow.MlflowClient(store)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())
    # The parent run as its training started it, with the code's digest then.
    started = record.code_digest(record.code_folders_in(project))
    run_id = client.create_run(experiment, tags={"code_sha256": started}).info.run_id
    (mode_dir / "mlflow_run.json").write_text(json.dumps({"experiment_id": experiment, "parent": run_id,
                                                          "children": {}}))
    op = {"op": "model", "run": run_id, "file": str(mode_dir / "model.pt"), "mode": "single",
          "example": torch.zeros(2, 1, 28, 28).tolist(), "registered": None, "workload": class_path}
    (outbox / "rank-0.jsonl").write_text(json.dumps(op) + "\n")
    source.write_text(source.read_text() + "\nEDITED_AFTER_TRAINING = True\n")  # before the store is back
    sent = run(["mnist-pipeline", "send-runs", "--mode", "single", "--to", store], project, **project_env(project))
    assert "sent 1 kept tracking calls" in sent.stdout, sent.stdout + sent.stderr
    said = client.get_run(run_id).data.tags["model_code"]
    # The digests of the copy's code (send-runs imports the project's, not this checkout's): at the
    # start, then after the edit.
    now = record.code_digest(record.code_folders_in(project))
    assert f"code_sha256 {started[:12]} then, {now[:12]} now" in said and "without the workload's package" in said, said
    assert "the project's code changed after its training" in sent.stderr, sent.stderr
    (model,) = client.search_logged_models([experiment])  # MLflow 3: a run's model is a logged model
    logged = Path(mlflow.artifacts.download_artifacts(artifact_uri=model.artifact_location, dst_path=tmp_path / "got"))
    assert (logged / "MLmodel").is_file() and not (logged / "code").exists()


def test_a_teams_own_data_is_prepared_trained_and_evaluated_by_the_stages(tmp_path):
    """examples/workloads/table.py, copied into a project as its docs say: a regression on a CSV
    file, its own prepare (the file checked, split, standardised) and split, MSE, and metrics that
    are not accuracy. prepare, train (single and 2-rank ddp, which agree to rounding) and evaluate
    run through the CLI; the gate takes one of its metrics. A table that is not what the params
    say is refused in one line, and prepare leaves nothing behind."""
    params = {**SMALL, "workload": TABLE, "data": {"seed": 3},
              "train": {**SMALL["train"], "batch_size": 64, "epochs": 3, "lr": 0.01},
              "evaluate": {"batch_size": 100, "min_test_accuracy": 0.9, "gate": "abs_error <= 0.6"}}
    project = make_project(tmp_path / "proj", params)
    table = add_table_workload(project)

    # A column the params name that the file lacks: one line, and no data/prepared.
    text = table.read_text()
    table.write_text(text.replace("x3", "x4", 1))
    refused = run(["mnist-pipeline", "prepare"], project, check=False)
    assert refused.returncode == 1 and "data/table.csv: no column 'x3'" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (project / "data/prepared").exists()
    table.write_text(text)

    said = run(["mnist-pipeline", "prepare"], project).stdout
    assert "prepared train 420, val 90, test 90 from data/table.csv (600 rows, 3 features)" in said, said
    for mode in ("single", "dp", "ddp"):
        run(["mnist-pipeline", "train", "--mode", mode], project)
    single, ddp = load_weights(project, "single"), load_weights(project, "ddp")
    assert relative_difference(single, ddp) < 1e-3 and relative_difference(single, load_weights(project, "dp")) < 1e-3
    curves = (project / "plots/train/single.csv").read_text().splitlines()
    first, last = (dict(zip(curves[0].split(","), line.split(","))) for line in (curves[1], curves[-1]))
    assert float(last["val_squared_error"]) < float(first["val_squared_error"])  # it learns

    run(["mnist-pipeline", "evaluate"], project, **project_env(project))
    scores = json.loads((project / "results/eval/ddp.json").read_text())
    assert scores.keys() == {"abs_error", "squared_error", "loss", "count"} and scores["count"] == 90
    assert scores["squared_error"] == pytest.approx(scores["loss"])  # MSE's loss is its squared error
    assert (project / "plots/confusion/single.png").read_bytes()[:4] == b"\x89PNG"  # outputs against targets
    # compare: its first metric where MNIST has accuracy, and every score in metrics/ for DVC.
    compared = run(["mnist-pipeline", "compare"], project, **project_env(project)).stdout
    assert "test abs_error" in compared and f"{scores['abs_error']:.4g}" in compared, compared
    assert "test squared_error" in compared and f"{scores['squared_error']:.4g}" in compared, compared
    metrics = json.loads((project / "metrics/ddp.json").read_text())
    assert metrics["abs_error"] == round(scores["abs_error"], 6) and "accuracy" not in metrics
    assert "| test abs_error | test squared_error |" in (project / "reports/comparison.md").read_text()
    # DVC's charts follow the workload: its validation scores, a panel each, and no MNIST accuracy.
    shown = json.loads(run(["dvc", "plots", "show", "--json"], project, **project_env(project)).stdout)
    assert shown.get("errors") is None, shown.get("errors")
    panels = {point["metric"] for point in shown["data"]["reports/val_scores.csv"][0]["content"]["data"]["values"]}
    assert panels == {"abs_error", "squared_error"}, panels
    both = ["--mode", "single", "--mode", "ddp"]
    # The gate on one of its metrics: a bound the model cannot meet fails the stage, naming it.
    (project / "params.yaml").write_text((project / "params.yaml").read_text().replace(
        "abs_error <= 0.6", "abs_error <= 0.001"))
    failed = run(["mnist-pipeline", "evaluate", "--mode", "single"], project, check=False, **project_env(project))
    assert failed.returncode == 1 and "fails evaluate.gate = 'abs_error <= 0.001'" in failed.stderr, failed.stderr
    # A gate naming a score the workload does not give: refused before anything is written.
    (project / "params.yaml").write_text((project / "params.yaml").read_text().replace(
        "abs_error <= 0.001", "accuracy >= 0.5"))
    before = (project / "results/eval/ddp.json").read_bytes()
    wrong = run(["mnist-pipeline", "evaluate", *both], project, check=False, **project_env(project))
    assert wrong.returncode == 1 and "scores abs_error, loss, squared_error on the test set, not accuracy" in wrong.stderr
    assert (project / "results/eval/ddp.json").read_bytes() == before

    # Data changed after prepare is found before anything trains on it.
    blob = torch.load(project / "data/prepared/train.pt", weights_only=True)
    blob["targets"][0] += 1
    torch.save(blob, project / "data/prepared/train.pt")
    changed = train_cli(project, "single", check=False)
    assert changed.returncode != 0 and "train.pt: changed since `prepare` wrote it" in changed.stderr, changed.stderr


@pytest.mark.fast
def test_evaluate_scores_any_workload_and_a_classifier_of_any_number_of_classes(tmp_path):
    from pipeline.evaluation import evaluate_model, evaluation_png
    from pipeline.loop import DeviceSplit

    class Squares(Workload):  # outputs against float targets: not a classifier
        def build_model(self):
            return nn.Linear(2, 1)

        def loss(self, outputs, targets):
            return F.mse_loss(outputs, targets, reduction="sum")

        def metrics(self, outputs, targets):
            return {"abs_error": (outputs - targets).abs().sum()}

        def example_batch(self):
            return torch.zeros(2, 2), torch.zeros(2, 1)

    inputs = torch.arange(10.0).reshape(5, 2)
    targets = inputs.sum(1, keepdim=True)
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.5)  # off by 0.5 everywhere
    result = evaluate_model(model, DeviceSplit(inputs, targets), batch_size=2, workload=Squares())
    assert result.summary() == {"abs_error": 0.5, "loss": 0.25, "count": 5} and result.accuracy is None
    evaluation_png(result, "outputs against targets", tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    # Three classes, MNIST's scores: the confusion matrix is 3x3, accuracy the share on its diagonal.
    logits = torch.eye(3)[[0, 1, 2, 2]]
    three = nn.Identity()
    result = evaluate_model(three, DeviceSplit(logits, torch.tensor([0, 1, 2, 0])), batch_size=3,
                            workload=Mnist(label_smoothing=0.0))
    assert result.confusion.tolist() == [[1, 0, 1], [0, 1, 0], [0, 0, 1]] and result.accuracy == 0.75
    assert result.summary()["per_class_accuracy"] == {"0": 0.5, "1": 1.0, "2": 1.0}


@pytest.mark.fast
def test_the_gate_is_a_score_a_comparison_and_a_number():
    from pipeline.config import parse_gate

    assert parse_gate("abs_error <= 0.5") == ("abs_error", "<=", 0.5)
    assert parse_gate(" r2>=-1e-3 ") == ("r2", ">=", -0.001) and parse_gate("") is None
    for bad in ("abs_error < 0.5", "0.5 >= abs_error", "abs error <= 1", "loss <= much"):
        with pytest.raises(ConfigError, match=r"evaluate.gate = .* is not allowed; allowed: '' or '<metric> >= "):
            config_from_dict({"evaluate": {"gate": bad}})


@pytest.mark.fast
def test_data_the_model_cannot_take_is_refused_before_training(tmp_path):
    """What example_batch() cannot show: the prepared samples are not what the model takes."""
    from torch.utils.data import TensorDataset

    from pipeline.workloads import Samples
    from stages.train import check_prepared

    class Wide(Workload):
        def build_model(self):
            return nn.Linear(3, 1)

        def loss(self, outputs, targets):
            return F.mse_loss(outputs, targets, reduction="sum")

        def metrics(self, outputs, targets):
            return {}

        def example_batch(self):
            return torch.zeros(2, 3), torch.zeros(2, 1)

        def split(self, data_dir, name):
            return Samples(TensorDataset(torch.zeros(8, 4), torch.zeros(8, 1)))  # 4 columns, not 3

    (tmp_path / "stats.json").write_text(json.dumps({"splits": {"train": {"count": 8}, "val": {"count": 8}}}))
    with pytest.raises(PipelineError, match=r"the model of workload workloads.wide.Wide fails on the first samples "
                                            r"of its train split \(RuntimeError: .*\); make prepare write what the "
                                            r"model takes"):
        check_prepared(tmp_path, 4, Wide(), "workloads.wide.Wide")


def test_a_teams_workload_runs_as_a_dvc_experiment_and_is_reproduced_bit_for_bit(tmp_path):
    """As docs/workloads.md tells a team: the example in workloads/, its table committed, prepare's
    deps and params given both, then `dvc exp run -S workload...` from MNIST's params. The runs
    record the code with workloads/ in it, `make show` heads the row with the workload's own score,
    and `reproduce` re-makes the training from its record, bit for bit."""
    import mlflow  # here: the fast tests above do without its import

    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "modes": ["single"], "epochs": 3,
                                                                    "batch_size": 64, "lr": 0.01}})
    add_table_workload(project)
    commit(project, "the team's workload")
    init_args = "{source: data/table.csv, features: [x1, x2, x3], target: y, hidden: 16}"
    run(["dvc", "exp", "run", "-n", "table", "-S", f"workload.class_path={TABLE['class_path']}",
         "-S", "~workload.init_args", "-S", f"+workload.init_args={init_args}",
         "-S", "evaluate.gate='abs_error <= 0.6'"], project, **project_env(project))

    metrics = json.loads((project / "metrics/single.json").read_text())
    assert "abs_error" in metrics and "accuracy" not in metrics, metrics
    shown = run([sys.executable, str(ROOT / "scripts/show_experiments.py")], project, **project_env(project)).stdout
    # A column per score of the table's; MNIST's rows (main) have none of them, and no accuracy here.
    header, *rows = shown.splitlines()
    assert "test abs_error" in header and "test squared_error" in header and "test accuracy" not in header, shown
    table = next(row for row in rows if row.split()[0] == "table")
    assert f" {metrics['abs_error']:.4g} " in table and f" {metrics['squared_error']:.4g} " in table, shown
    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    parent_id = json.loads((project / "models/single/mlflow_run.json").read_text())["parent"]
    parent = client.get_run(parent_id)
    assert parent.info.run_name == "table/single" and parent.data.params["workload.class_path"] == TABLE["class_path"]
    head = run(["git", "rev-parse", "HEAD"], project).stdout.strip()
    assert parent.data.tags["code_sha256"] == code_at(project, head)  # workloads/table.py in it
    proc = run(["mnist-pipeline", "reproduce", parent_id], project, check=False, **project_env(project))
    said = [line for line in proc.stdout.splitlines() if line.startswith("reproduce: ")]
    assert proc.returncode == 0 and said[-1].startswith("reproduce: reproduced bit for bit"), proc.stdout + proc.stderr
