"""`make show` (scripts/show_experiments.py) on the shape `dvc exp show --json` gives: the fixed
params, then whatever differs between the rows. The real `dvc exp show` of a sweep is read in
tests/test_dvc_experiments_tracking.py."""

import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.fast

sys.path.insert(0, str(ROOT / "scripts"))
import show_experiments  # noqa: E402


def entry(name: str, train: dict, metrics: dict | None = None) -> dict:
    return {"name": name, "params": {"train": {"lr": 0.02, "weight_decay": 0.0, "modes": ["single"], **train},
                                     "data": {"val_size": 5000},
                                     "workload": {"init_args": {"model": "small", "label_smoothing": 0.1}}},
            "metrics": {"metrics/single.json": metrics} if metrics else {}}


def test_a_swept_param_gets_a_column_and_an_unswept_one_does_not():
    found = [entry("workspace", {}, {"accuracy": 0.99, "speedup": 1.0}), entry("  wd", {"weight_decay": 0.001}),
             {"name": "before-params", "params": {}, "metrics": {}}]  # a commit from before params.yaml
    assert show_experiments.shown_params(found) == [*show_experiments.PARAMS, "train.weight_decay"]
    lines = show_experiments.table(found).splitlines()
    header = lines[0].split()
    assert "weight_decay" in header and "val_size" not in header and "data.val_size" not in header
    assert lines[2].split()[header.index("weight_decay")] == "0.001"
    assert lines[1].split()[header.index("test")] == "99.00%"  # "test acc": two words in the header
    # A param outside train is named with its section.
    found.append(entry("  val", {}) | {"params": {"train": {}, "data": {"val_size": 1000}}})
    header = show_experiments.table(found).splitlines()[0].split()
    params = header[:header.index("mode")]
    assert "data.val_size" in params and "train" not in params  # a section emptied is no column of its own


def test_the_speedup_shows_its_interval_and_the_warnings_their_count():
    found = [entry("workspace", {}, {"accuracy": 0.99, "speedup": 1.7, "speedup_low": 1.61, "speedup_high": 1.8,
                                     "timing_warnings": 2})]
    line = show_experiments.table(found).splitlines()[1]
    assert "1.70x (1.61-1.80)" in line and line.split()[-1] == "2"


def test_names_in_wide_scripts_keep_the_columns_aligned():
    """A CJK name takes two terminal columns a character: the columns after it start where the
    other rows' do, counted in display width, not code points."""
    found = [entry("学習率の実験", {"lr": 0.03}, {"accuracy": 0.99, "speedup": 1.0}),
             entry("workspace", {}, {"accuracy": 0.98, "speedup": 1.0})]
    lines = show_experiments.table(found).splitlines()
    starts = [show_experiments.display_width(line[:line.index("single")]) for line in lines[1:]]
    assert starts[0] == starts[1], lines


def test_a_workload_without_accuracy_shows_each_of_its_scores():
    """A regression's metrics/<mode>.json holds its scores beside compare's numbers: a column each,
    as compare's table has; a row of another workload (MNIST's accuracy) has "-" in them, and they
    in its."""
    found = [entry("  table", {}, {"abs_error": 0.31234, "squared_error": 0.2, "loss": 0.2, "samples_per_s": 900.0,
                                   "speedup": 1.0, "speedup_low": 0.9, "speedup_high": 1.1, "step_ms": 3.0}),
             entry("workspace", {}, {"accuracy": 0.975, "loss": 0.08, "speedup": 1.0})]
    lines = show_experiments.table(found).splitlines()
    header = lines[0].split()
    start = header.index("mode") + 1
    assert header[start:start + 6] == ["test", "accuracy", "test", "abs_error", "test", "squared_error"], header
    assert lines[1].split()[start - 1:start + 3] == ["single", "-", "0.3123", "0.2"], lines
    assert lines[2].split()[start - 1:start + 3] == ["single", "97.50%", "-", "-"], lines
    assert show_experiments.scores([{"loss": 0.25, "speedup": 1.0}]) == ["loss"]
    # Rows of other workloads alone: no column for MNIST's model, which none of them has.
    for row in found:
        row["params"] = {**row["params"], "workload": {"class_path": "workloads.table.Regression", "init_args": {}}}
    assert "workload.init_args.model" not in show_experiments.table(found).splitlines()[0]
    assert show_experiments.score({"loss": 0.25}, "loss") == "0.25"


def test_every_mode_has_its_row_fsdp_too():
    numbers = {"accuracy": 0.97, "speedup": 1.0}
    found = [{"name": "workspace", "params": {"train": {"modes": ["single", "ddp", "fsdp"]}},
              "metrics": {f"metrics/{mode}.json": numbers for mode in ("fsdp", "single", "ddp")}}]
    lines = show_experiments.table(found).splitlines()
    # The mode, then five cells of one word each: accuracy, samples/s, speed-up, train time, warnings.
    assert [line.split()[-6] for line in lines[1:]] == ["single", "ddp", "fsdp"], lines
