import dataclasses

import pytest
import yaml

from pipeline.config import Config, DataConfig, TrainConfig, config_from_dict, flatten, load_config
from pipeline.errors import ConfigError
from tests.conftest import ROOT

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`


def test_project_params_load():
    config = load_config(ROOT / "params.yaml")
    assert isinstance(config.data, DataConfig) and isinstance(config.train, TrainConfig)
    assert set(config.train.modes) == {"single", "dp", "ddp"}


def test_the_defaults_are_params_yamls():
    # A key left out of a user's params file means what the project's params.yaml says.
    assert load_config(ROOT / "params.yaml") == Config()


def test_config_is_frozen():
    config = config_from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.lr = 1.0


def test_empty_params_give_defaults():
    assert config_from_dict({}) == Config()


@pytest.mark.parametrize(
    "raw, fragments",
    [
        ({"trian": {}}, ["unknown section 'trian'", "train"]),
        ({"train": {"lr_max": 1}}, ["unknown key 'train.lr_max'", "lr"]),
        ({"train": {"lr": -0.1}}, ["train.lr = -0.1", "> 0"]),
        ({"train": {"lr": 0}}, ["train.lr = 0", "> 0"]),
        ({"train": {"lr": "fast"}}, ["train.lr = 'fast'", "a number"]),
        ({"train": {"optimizer": "lamb"}}, ["train.optimizer = 'lamb'", "one of ('adam', 'adamw', 'sgd')"]),
        ({"train": {"schedule": "step"}}, ["train.schedule = 'step'", "'onecycle', 'cosine', 'constant'"]),
        ({"train": {"momentum": 1.0}}, ["train.momentum = 1.0", "up to, not including, 1"]),
        ({"train": {"batch_size": 0}}, ["train.batch_size = 0", ">= 1"]),
        ({"train": {"batch_size": 12.5}}, ["train.batch_size = 12.5", "an integer"]),
        ({"train": {"epochs": True}}, ["train.epochs = True", "an integer"]),
        ({"train": {"modes": ["single", "tp"]}}, ["train.modes", "tp", "fsdp"]),
        ({"train": {"modes": []}}, ["train.modes = []", "non-empty"]),
        ({"workload": {"class_path": "Mnist"}}, ["workload.class_path = 'Mnist'", "an import path, module.Class"]),
        ({"workload": {"init_args": ["small"]}}, ["workload.init_args = ['small']", "a mapping"]),
        ({"workload": {"init_args": {"1st": 2}}}, ["workload.init_args = {'1st': 2}", "keyword-argument names"]),
        ({"train": {"bf16": "yes"}}, ["train.bf16 = 'yes'", "true or false"]),
        ({"data": {"val_size": 60000}}, ["data.val_size = 60000", "< 60000"]),
        ({"data": {"val_size": 500, "train_limit": 500}}, ["data.val_size = 500", "data.train_limit"]),
        ({"data": {"train_limit": -1}}, ["data.train_limit = -1", ">= 0"]),
        ({"data": [1, 2]}, ["section 'data' must be a mapping"]),
        ({"train": {"seed": 2**64}}, [f"train.seed = {2**64}", "from 0 to 2**63 - 1"]),  # torch.manual_seed's 64 bits
        ({"data": {"seed": -1}}, ["data.seed = -1", "from 0 to 2**63 - 1"]),
    ],
)
def test_bad_values_name_key_value_and_rule(raw, fragments):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, source="my-params.yaml")
    message = str(info.value)
    assert message.startswith("my-params.yaml: ")
    for fragment in fragments:
        assert fragment in message


def test_int_accepted_where_float_expected():
    assert config_from_dict({"train": {"lr": 1}}).train.lr == 1


def full_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.parametrize("written, key, expected", [
    ("lr: 1e-3", ("train", "lr"), 0.001), ("lr: 5E-2", ("train", "lr"), 0.05),
    ("lr: 2e-2", ("train", "lr"), 0.02), ("max_bytes: 4e6", ("commcheck", "max_bytes"), 4_000_000),
])
def test_numbers_written_the_way_people_write_them(tmp_path, written, key, expected):
    section, name = key
    text = (ROOT / "params.yaml").read_text()
    line = next(line for line in text.splitlines() if line.strip().startswith(f"{name}:"))
    path = tmp_path / "params.yaml"
    path.write_text(text.replace(line, f"  {written}"))
    assert isinstance(yaml.safe_load(path.read_text())[section][name], str)  # what YAML 1.1 reads
    value = getattr(getattr(load_config(path), section), name)
    assert value == expected and type(value) is type(expected)


def test_a_number_that_is_not_whole_is_no_integer(tmp_path):
    with pytest.raises(ConfigError, match="train.epochs = '2.5' has the wrong type; allowed: an integer"):
        config_from_dict({"train": {"epochs": "2.5"}})


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n"])
def test_an_empty_params_file_is_an_error(tmp_path, text):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{path}: empty; it must hold every section"):
        load_config(path)


def test_a_truncated_params_file_is_an_error(tmp_path):
    text = (ROOT / "params.yaml").read_text()
    path = tmp_path / "params.yaml"
    path.write_text(text[: text.index("  lr:")])  # cut in the middle of `train`
    with pytest.raises(ConfigError, match=rf"{path}: missing key 'train.lr' and \d+ more \(a truncated file\?\)"):
        load_config(path)


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"train": {"epoch": 3}}))
    with pytest.raises(ConfigError, match=rf"{typo}: unknown key 'train.epoch'"):
        load_config(typo)


def test_flatten_uses_dotted_keys():
    flat = flatten(config_from_dict({"train": {"epochs": 3}}))
    assert flat["train.epochs"] == 3
    assert flat["train.modes"] == ["single", "dp", "ddp"]
    assert flat["data.val_size"] == 5000
