"""`train.compile` (#56): torch.compile over the model each mode trains. Compiled, the modes train
what eager single trains, to rounding, at 2 ranks (ddp, fsdp); a compiled training killed mid-epoch
resumes bit for bit; and what cannot compile is refused in one line. The trainings are the
pipeline's own loop in processes of their own (tests/ddp_harness.py), so Dynamo's state is theirs."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.checkpoint import CHECKPOINT_FILE, read_checkpoint, settings_changed, trajectory
from pipeline.compiled import check_can_compile, compile_forwards, graphs_compiled, uncompile
from pipeline.config import TrainConfig, WorkloadConfig
from pipeline.errors import ConfigError
from pipeline.loop import Training, build, train
from pipeline.parallel import Rank
from tests.conftest import relative_difference
from tests.ddp_harness import CLASSIC, equal, learnable_data, rank_dir, run_ranks, train_config

# 400 images in batches of 40: 10 steps an epoch; the resumed training checkpoints every 4 steps and
# is killed after step 8's, mid-epoch.
EVERY, KILLED_AFTER = 4, 8


def config(compiled: bool = True, **changes) -> TrainConfig:
    return dataclasses.replace(train_config(batch_size=40), compile=compiled, **changes)


def data():
    return learnable_data(400), learnable_data(50, seed=1)


def trainer(r: int, world: int, out, runs: list[tuple[str, str, TrainConfig]]) -> None:
    """Rank r of each (name, mode, config) in turn; rank 0 saves each one's weights, history and the
    graphs compiled during it. "ddp killed" dies after step KILLED_AFTER's checkpoint (so it comes
    last) and "ddp resumed" goes on from it; they and "ddp whole" train the classic model (dropout)."""
    for name, mode, cfg in runs:
        folder = rank_dir(out / name.replace("killed", "resumed"), r)
        state = None
        if name.endswith("killed"):
            os.environ["MNIST_PIPELINE_CRASH_AFTER_STEP"] = str(KILLED_AFTER)
        if name.endswith("resumed"):
            state = read_checkpoint(out / "ddp resumed" / "rank-0" / CHECKPOINT_FILE)
        before = graphs_compiled()
        run = Training(cfg, mode, Rank(r, r, world, world), torch.device("cpu"), folder, resume_state=state,
                       workload=CLASSIC if name.startswith("ddp ") else WorkloadConfig())
        model, history = train(run, *data())
        if r == 0:
            torch.save({"weights": model.state_dict(), "history": history, "graphs": graphs_compiled() - before},
                       out / f"{name}.pt")


def load(out, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


def test_compiled_modes_train_what_eager_single_trains_and_resume_bit_for_bit(tmp_path):
    checkpointed = config(checkpoint_every_steps=EVERY)
    run_ranks(1, trainer, tmp_path, [("single eager", "single", config(False)), ("single", "single", config())])
    # fsdp first: the 2-rank processes then train ddp uninterrupted and die mid-epoch, and fresh ones resume.
    with pytest.raises(mp.ProcessExitedException, match="exit code 75"):
        run_ranks(2, trainer, tmp_path, [("fsdp", "fsdp", config()), ("ddp", "ddp", config()),
                                         ("ddp whole", "ddp", checkpointed), ("ddp killed", "ddp", checkpointed)])
    run_ranks(2, trainer, tmp_path, [("ddp resumed", "ddp", checkpointed)])

    eager, single = load(tmp_path, "single eager"), load(tmp_path, "single")
    assert eager["graphs"] == 0
    # Compiled kernels round otherwise than eager ones (Adam's first steps magnify it: 1.2e-4 here),
    # so the comparison with eager single could not tell compiled from not: it must differ at all.
    compiled_against_eager = relative_difference(eager["weights"], single["weights"])
    print(f"single, compiled, against eager single: relative difference {compiled_against_eager:.2e}")
    assert 0 < compiled_against_eager < 1e-3
    assert single["history"][0]["train_loss"] == pytest.approx(eager["history"][0]["train_loss"], rel=1e-5)
    # Compiled, the modes agree as eager ones do (2.6e-6 at 2 ranks), well inside the gap to eager.
    for name in ("single", "ddp", "fsdp"):
        trained = load(tmp_path, name)
        assert trained["graphs"] > 0, f"{name}: nothing was compiled"
        difference = relative_difference(single["weights"], trained["weights"])
        print(f"{name}, compiled, against compiled single: relative difference {difference:.2e}")
        assert difference < 2e-5

    whole, resumed = load(tmp_path, "ddp whole"), load(tmp_path, "ddp resumed")
    assert resumed["graphs"] > 0 and resumed["history"][-1]["resumed_at_step"] == KILLED_AFTER
    assert equal(whole["weights"], resumed["weights"])
    assert resumed["history"][-1]["train_loss"] == whole["history"][-1]["train_loss"]


@pytest.mark.fast
def test_what_cannot_compile_is_refused_in_one_line(monkeypatch):
    check_can_compile("cpu", "single")  # this machine has g++ and Python's headers
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ConfigError, match=r"^train.compile is true, but this machine has no C\+\+ compiler "
                                          r"'no-such-compiler' \(CXX, else g\+\+\).*set train.compile false$"):
        check_can_compile("cpu", "ddp")
    monkeypatch.setenv("CC", "")  # Triton would run "" as its compiler
    with pytest.raises(ConfigError, match=r"no C compiler at CC='', which Triton builds its GPU launcher with"):
        check_can_compile("cuda", "single")
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match=r"no C compiler \(CC, gcc or clang\), which Triton builds"):
        check_can_compile("cuda", "single")
    with pytest.raises(ConfigError, match=r"dp splits each batch over 2 GPUs with DataParallel, which torch.compile "
                                          r"cannot compile: train dp with train.compile false, or use ddp"):
        check_can_compile("cuda", "dp", dp_devices=2)


@pytest.mark.fast
def test_compiling_keeps_the_model_as_saved_and_a_resume_keeps_the_setting():
    model, _, _ = build(TrainConfig(), 10, torch.device("cpu"))
    keys = list(model.state_dict())
    compile_forwards([model])
    assert list(model.state_dict()) == keys and "forward" in vars(model)  # compiled lazily, at its first call
    uncompile(model)  # what train hands on: the class's own forward again
    assert "forward" not in vars(model) and list(model.state_dict()) == keys
    eager, compiled = TrainConfig(), TrainConfig(compile=True)
    assert settings_changed({"trajectory": trajectory(eager, "ddp")}, trajectory(compiled, "ddp")) == \
        "compile: False -> True"
    before = {key: value for key, value in trajectory(eager, "ddp").items() if key != "compile"}
    assert settings_changed({"trajectory": before}, trajectory(eager, "ddp")) == ""
