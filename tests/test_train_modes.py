"""The three modes train the same function of the same batches: a test, not a hope."""

import json
from pathlib import Path

import pytest
import torch

from pipeline.loop import epoch_order, global_batches, rank_share, steps_per_epoch
from pipeline.parallel import Rank
from tests.conftest import SMALL, load_weights, max_abs_diff, relative_difference, train_cli
from tests.ddp_harness import CLASSIC, train_config


def test_ddp_shards_are_the_single_batches():
    n, batch = 1003, 100
    single = global_batches(epoch_order(n, 3, 7), batch)
    assert len(single) == steps_per_epoch(n, batch) == 11 and len(single[-1]) == 3
    for world in (2, 4):  # where W divides the batch: exactly DistributedSampler's shards, batch by batch
        sampler = [epoch_order(n, 3, 7)[r::world] for r in range(world)]  # its order, before padding
        for r in range(world):
            shares = torch.cat([rank_share(b, Rank(r, r, world, world)) for b in single])
            assert torch.equal(shares, sampler[r])
    assert not torch.equal(epoch_order(n, 3, 7), epoch_order(n, 4, 7))  # set_epoch


def test_ddp_matches_single_and_ranks_stay_in_sync(small_project):
    train_cli(small_project, "single")
    ddp = train_cli(small_project, "ddp")
    assert "launching 2 workers" in ddp.stdout
    single, ddp = load_weights(small_project, "single"), load_weights(small_project, "ddp")
    # The same batches, summed in another order: float32 rounding differs in the last bits, and
    # Adam, which divides by the gradient's running size, magnifies that for the few weights whose
    # gradients are near zero. So a few weights drift by up to 1e-3 while the whole barely moves.
    difference = relative_difference(single, ddp)
    print(f"after 20 steps: relative |single - ddp| {difference:.2e}, max {max_abs_diff(single, ddp):.2e}")
    assert difference < 1e-3
    summary = json.loads((small_project / "results/train/ddp.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "gloo" and summary["batch_shares"] == "50/50"


def test_fsdp_matches_single_and_saves_the_whole_model(small_project):
    """FSDP2 (`fully_shard`) through the stage: torchrun's workers, each holding half of every
    parameter; what it saves, checkpoints and logs is the whole model, as the other modes'."""
    fsdp = train_cli(small_project, "fsdp")
    assert "launching 2 workers" in fsdp.stdout
    single, sharded = load_weights(small_project, "single"), load_weights(small_project, "fsdp")
    assert {key: value.shape for key, value in sharded.items()} == {key: value.shape for key, value in single.items()}
    difference = relative_difference(single, sharded)
    print(f"after 20 steps: relative |single - fsdp| {difference:.2e}, max {max_abs_diff(single, sharded):.2e}")
    assert 0 < difference < 1e-3  # the same training, its sums in another order (as ddp's)
    summary = json.loads((small_project / "results/train/fsdp.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "gloo" and summary["batch_shares"] == "50/50"
    state = torch.load(small_project / "models/fsdp/checkpoint.pt", weights_only=True)
    assert state["model"].keys() == single.keys() and torch.equal(state["model"]["0.weight"], sharded["0.weight"])
    # The optimizer's state is whole too (keyed by the parameters' names): Adam's moments of every weight.
    assert {key: value.shape for key, value in state["optimizer"]["state"]["0.weight"].items()
            if key != "step"} == {"exp_avg": single["0.weight"].shape, "exp_avg_sq": single["0.weight"].shape}


def test_dp_on_cpu_is_the_bare_module_and_matches_single(small_project):
    dp = train_cli(small_project, "dp")
    assert "bare module" in dp.stderr
    assert max_abs_diff(load_weights(small_project, "single"), load_weights(small_project, "dp")) == 0.0
    assert json.loads((small_project / "results/train/dp.json").read_text())["dp_devices"] == 1


def test_every_rank_holds_the_same_weights_after_every_epoch(small_project):
    state = torch.load(small_project / "models/ddp/checkpoint.pt", weights_only=True)
    assert len(state["history"]) == 2
    for epoch in state["history"]:
        assert len(epoch["rank_weight_checksums"]) == 2
        assert len(set(epoch["rank_weight_checksums"])) == 1


def test_resume_after_a_crash_ends_with_the_uninterrupted_weights(small_project):
    reference = load_weights(small_project, "single")  # uninterrupted, from the test above
    crashed = train_cli(small_project, "single", check=False, MNIST_PIPELINE_CRASH_AFTER_EPOCH="1")
    assert crashed.returncode == 75
    assert torch.load(small_project / "models/single/checkpoint.pt", weights_only=True)["epoch"] == 1
    resumed = train_cli(small_project, "single", "--resume")
    assert "epoch 1/2" not in resumed.stderr and "epoch 2/2" in resumed.stderr
    assert max_abs_diff(reference, load_weights(small_project, "single")) == 0.0


def test_resume_without_checkpoint_or_with_changed_settings(small_project, tmp_path):
    params = small_project / "params.yaml"
    changed = tmp_path / "params.yaml"
    changed.write_text(params.read_text().replace("lr: 0.02", "lr: 0.03"))
    result = train_cli(small_project, "single", "--resume", "--params", str(changed), check=False)
    assert result.returncode == 1 and "lr: 0.02 -> 0.03" in result.stderr


@pytest.mark.parametrize(
    "args, params, message",
    [
        (["--mode", "ddp"], {"batch_size": 1}, "train.batch_size = 1 is smaller than the 2 DDP ranks"),
        (["--mode", "single"], {"device": "cuda"}, "train.device is cuda, but no GPU is visible"),
        (["--mode", "ddp"], {"device": "cuda"}, "train.device is cuda, but no GPU is visible"),
        (["--mode", "tp"], {}, "'tp' is not one of 'single', 'dp', 'ddp', 'fsdp'"),
        (["--mode", "fsdp"], {"batch_size": 1}, "train.batch_size = 1 is smaller than the 2 DDP ranks"),
        (["--mode", "single", "--data-dir", "nowhere"], {}, "nowhere/stats.json: missing; run `mnist-pipeline prepare`"),
        (["--mode", "ddp", "--data-dir", "nowhere"], {}, "nowhere/stats.json: missing"),
    ],
)
def test_bad_input_is_a_clear_error(small_project, tmp_path, args, params, message):
    import yaml

    from tests.conftest import project_env, run

    raw = yaml.safe_load((small_project / "params.yaml").read_text())
    raw["train"].update(params)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = run(["mnist-pipeline", "train", "--params", str(path), *args], small_project, check=False,
                 **project_env(small_project))
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_the_phase_clock_keeps_microsecond_phases():
    """An optimizer step of 20 us a step on a fast GPU must not round to zero (it did at 4 decimals)."""
    from pipeline.breakdown import StepClock

    clock = StepClock(torch.device("cpu"))
    for step in range(3):  # three steps whose phases each take about a microsecond
        clock.start_step(step, stamped=True)
        for _ in range(StepClock.PER_STEP - 1):
            clock.mark()
    totals = clock.totals()
    assert set(totals) == set(StepClock.PHASES)
    assert all(0 < seconds < 1 for seconds in totals.values())


def test_a_resume_at_an_odd_world_size_ends_with_the_uninterrupted_weights(small_project, tmp_path):
    """An outer torchrun (a user's, a scheduler's) restarts the crashed workers, which resume from
    the checkpoint by themselves: at 3 ranks, batch 100 dealt out 34/33/33, killed mid-epoch after
    a checkpoint every 3 steps (train.checkpoint_every_steps). The crashed and restarted training
    reads its samples through a DataLoader (train.loader, 2 worker processes a rank), the reference
    holds them in memory: the same weights, bit for bit (#53). (One test holds all four: each claim
    costs a training, a crash and a restart.)"""
    from tests.conftest import project_env, run, write_params

    settings = {**SMALL["train"], "nproc": 3, "checkpoint_every_steps": 3}
    params = write_params(tmp_path / "params.yaml", train=settings)
    train_cli(small_project, "ddp", "--params", str(params))
    reference = load_weights(small_project, "ddp")
    assert json.loads((small_project / "results/train/ddp.json").read_text())["batch_shares"] == "34/33/33"
    loaded = write_params(tmp_path / "loaded.yaml", train={**settings, "loader": "dataloader", "loader_workers": 2})
    proc = run(["torchrun", "--standalone", "--nproc-per-node", "3", "--max-restarts", "1",
                "-m", "stages", "train", "--mode", "ddp", "--params", str(loaded)], small_project,
               **project_env(small_project, MNIST_PIPELINE_CRASH_AFTER_STEP="15"))
    assert "launching" not in proc.stdout  # workers, not a second launcher
    assert proc.stderr.count("read from data/prepared by DataLoaders, 2 worker process(es) each") == 2
    assert "crashing after step 15" in proc.stderr  # the 5th of epoch 2's 10 steps
    # Epoch 1 ran once, before the crash; the restarted workers went on from epoch 2's 6th step.
    assert proc.stderr.count("ddp epoch 1/2") == 1 and proc.stderr.count("ddp epoch 2/2") == 1
    assert max_abs_diff(reference, load_weights(small_project, "ddp")) == 0.0
    results = json.loads((small_project / "results/train/ddp.json").read_text())
    assert results["unmeasured"].startswith("the last epoch was resumed at its step 5 from a mid-epoch checkpoint")


def test_the_steady_state_leaves_out_the_warm_up_steps():
    from pipeline.breakdown import StepClock

    clock = StepClock(torch.device("cpu"))
    clock.marks = {0: [0.0, 1.0, 2.0, 2.5, 3.0], 1: [10.0, 11.0, 12.0, 12.5, 13.0]}  # two steps, 5 marks each
    assert clock.seconds_since_step(0) == 13.0 and clock.seconds_since_step(1) == 3.0
    assert clock.seconds_since_step(2) is None  # no step after the warm-up


def test_steady_throughput_is_measured_after_the_warm_up(tmp_path):
    from pipeline.config import TrainConfig
    from pipeline.loop import Training, train
    from tests.ddp_harness import learnable_data

    config = TrainConfig(batch_size=8, throughput_warmup_steps=3)
    _, history = train(Training(config, "single", Rank(), torch.device("cpu"), tmp_path),
                       learnable_data(80), learnable_data(9, seed=1))
    epoch = history[0]
    assert 0 < epoch["steady_time_s"] < epoch["train_time_s"]
    assert epoch["steady_samples_per_s"] == pytest.approx(56 / epoch["steady_time_s"])  # 7 of 10 steps of 8


def _dropout_masks(r: int, world: int, out: str) -> None:
    """What each rank's dropout draws in an epoch, as the loop seeds it."""
    from pipeline.loop import build, seed_dropout
    from pipeline.workloads import load_workload

    model, _, _ = build(train_config(8), 10, torch.device("cpu"), load_workload(CLASSIC))
    seed_dropout(42, epoch=0, rank=r, dp_gpus=[])
    mask = torch.nn.functional.dropout(torch.ones(64, 128), 0.5).ne(0)
    torch.save({"weights": model.state_dict(), "mask": mask}, Path(out) / f"rank-{r}.pt")


def test_ddp_ranks_start_from_the_same_weights_and_drop_different_units(tmp_path):
    from tests.ddp_harness import run_ranks

    run_ranks(2, _dropout_masks, str(tmp_path))
    first, second = (torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in range(2))
    assert all(torch.equal(first["weights"][k], second["weights"][k]) for k in first["weights"])
    assert not torch.equal(first["mask"], second["mask"])


@pytest.mark.fast
def test_what_changed_in_the_code_or_the_data_is_named(tmp_path):
    from pipeline.checkpoint import inputs_changed, inputs_snapshot

    (tmp_path / "pipeline").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "pipeline" / "loop.py").write_text("x = 1\n")
    (tmp_path / "pipeline" / ".#loop.py").symlink_to("nobody@host.1234")  # an editor's lock: a link to nowhere
    (tmp_path / "data" / "train.pt").write_bytes(b"images")
    folders, data = [tmp_path / "pipeline"], tmp_path / "data"
    then = inputs_snapshot(data, folders)
    assert list(then["code"]) == ["pipeline/loop.py"] and inputs_changed(then, inputs_snapshot(data, folders)) is None
    (tmp_path / "data" / "train.pt").write_bytes(b"other images")
    assert inputs_changed(then, inputs_snapshot(data, folders)) == "data/train.pt changed"
    (tmp_path / "pipeline" / "extra.py").write_text("")
    assert inputs_changed(then, inputs_snapshot(data, folders)) == "pipeline/extra.py appeared"
    assert "older version" in inputs_changed("0123abcd", then)  # an interrupted training's record from before


def test_resume_after_a_code_edit_is_refused_and_an_edit_during_training_is_not_recorded(tmp_path, mnist_dir):
    """--resume would finish a training with other code than its record names; an edit saved while
    it trains would go into dvc.lock beside a model of the old code (DVC hashes after the stage)."""
    import hashlib
    import subprocess

    from tests.conftest import make_project, prepare, project_env, subprocess_env

    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "epochs": 4}})
    prepare(project, mnist_dir)
    report = project / "pipeline" / "report.py"

    from mlflow import MlflowClient

    # Trained here, and by DDP's workers (forks of its fork server). Each step pauses (the loop's test
    # hook), so the epochs after the second last 4 s: the edit is saved while the training runs.
    for mode in ("single", "ddp"):
        with subprocess.Popen(["mnist-pipeline", "train", "--mode", mode], cwd=project, stderr=subprocess.PIPE,
                              text=True, env=subprocess_env(**project_env(project, MNIST_PIPELINE_STEP_PAUSE_S="0.2"))
                              ) as proc:
            lines = []
            for line in proc.stderr:
                lines.append(line)
                if f"{mode} epoch 2/4" in line:  # training: save a file of the code
                    report.write_text(report.read_text() + "# another edit\n")
            proc.wait(timeout=300)
        output = "".join(lines)
        assert proc.returncode == 1, output[-2000:]
        assert "pipeline/report.py changed while this training ran: its outputs are of the code and data" in output, \
            output[-2000:]
        assert (project / "models" / mode / "unfinished.json").is_file()  # not recorded as a finished training
        run_id = json.loads((project / "models" / mode / "mlflow_run.json").read_text())["parent"]
        # Said before the runs ended: not a FINISHED run whose record names the code at its start.
        assert MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_run(run_id).info.status == "FAILED"

    # The single training the edit failed is left interrupted (its record, unfinished.json, names the
    # code at its start): --resume would finish it with the code as it is now. A crashed training of
    # its own would cost a process and nothing more: pick_up refuses on the record, before the checkpoint.
    checkpoint = project / "models/single/checkpoint.pt"
    kept = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    refused = train_cli(project, "single", "--resume", check=False)
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert ("models/single: pipeline/report.py changed since this training started, so --resume would finish it "
            "with other code or data than its record names") in refused.stderr, refused.stderr[-2000:]
    assert hashlib.sha256(checkpoint.read_bytes()).hexdigest() == kept  # kept, byte for byte
    assert (project / "models/single/unfinished.json").is_file()
