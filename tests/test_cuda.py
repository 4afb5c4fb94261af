"""What only happens on NVIDIA GPUs. Skipped (never passed) without CUDA; `make gpu-check` runs
them on any CUDA host, then the default pipeline, and prints one summary table."""

import json
import re
import threading
import time

import pytest
import torch
from torch import nn

from pipeline.breakdown import Probe, StepClock
from pipeline.loop import peak_memory_mb
from pipeline.model import build_model
from pipeline.workloads.mnist import Mnist
from pipeline.precision import AutocastForward, autocast_dtype
from tests.conftest import (SMALL, load_weights, make_project, max_abs_diff, prepare, project_env, relative_difference,
                            run, train_cli, write_params)
from tests.tolerances import BF16_ACCURACY_TOLERANCE, FP32_RELATIVE_TOLERANCE

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")]

@pytest.fixture(scope="module")
def gpu_project(tmp_path_factory, mnist_dir):
    """The small slice, one DDP worker per GPU, a global batch of 100: dealt out unevenly on 3, 6, 7
    and 8 GPUs (the 1,000 training images end on a full batch). float32 with TF32 off, where the
    modes must agree to rounding; bf16 has a check of its own."""
    project = make_project(tmp_path_factory.mktemp("gpu") / "proj",
                           {**SMALL, "train": {**SMALL["train"], "batch_size": 100, "nproc": 0, "bf16": False}})
    prepare(project, mnist_dir)
    return project


def test_bf16_inside_every_dataparallel_replica():
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    seen, lock = [], threading.Lock()
    model = build_model("small").cuda()

    def record(module, inputs, output):
        with lock:
            seen.append((output.device.index, output.dtype))

    model[0].register_forward_hook(record)
    replicated = nn.DataParallel(AutocastForward(model, "cuda", torch.bfloat16))
    images = torch.randn(16 * torch.cuda.device_count(), 1, 28, 28, device="cuda")
    replicated(images)
    assert {index for index, _ in seen} == set(range(torch.cuda.device_count()))
    assert {dtype for _, dtype in seen} == {torch.bfloat16}


def test_dataparallel_replicas_draw_dropout_masks_of_their_own():
    """torch.manual_seed seeds every GPU's generator alike: without a stream each, every replica
    would drop the same units of its different samples."""
    from pipeline.loop import seed_dropout

    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip("DataParallel needs two GPUs to have two replicas")
    replicated = nn.DataParallel(nn.Dropout(0.5).cuda())
    seed_dropout(42, epoch=0, rank=0, dp_gpus=list(range(gpus)))
    masks = replicated(torch.ones(4 * gpus, 1024, device="cuda")).ne(0).chunk(gpus)
    assert all(not torch.equal(masks[0], other) for other in masks[1:])


def test_bf16_only_where_native():
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert autocast_dtype(torch.device("cuda", 0), bf16=True) == (torch.bfloat16 if native else None)
    assert autocast_dtype(torch.device("cuda", 0), bf16=False) is None


class CountedEvent(torch.cuda.Event):
    """A real CUDA event that counts its records: each is a launch on the step's path."""

    recorded = 0

    def record(self, stream=None):
        CountedEvent.recorded += 1
        return super().record(stream)


def test_phase_clock_reads_cuda_events_only_where_read(monkeypatch):
    """The window's phases from CUDA events, at full precision, within the wall time; events only on
    the window's steps and the epoch's last (the first steady step is the window's first here)."""
    monkeypatch.setattr(torch.cuda, "Event", CountedEvent)
    probe = Probe(torch.device("cuda", 0), window=3, warmup=1)
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    started = time.perf_counter()
    probe.start_epoch(8, measure=True)
    for step in range(8):
        probe.start_step(step)
        b = a @ a
        probe.phase("forward")
        b = b @ a
        probe.phase("backward")
        b = b @ a
        probe.phase("optimizer")
        b.sum()
        probe.end_step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    assert CountedEvent.recorded == 4 * StepClock.PER_STEP  # steps 1 to 3, and 7
    results = probe.results()
    medians = results["median_s"]
    assert results["steps"] == 3 and all(medians[phase] > 0 for phase in ("data", "forward", "backward", "optimizer"))
    assert 3 * medians["step"] <= wall * 1.05
    assert 0 < probe.clock.seconds_since_step(1) <= wall * 1.05
    assert probe.clock.totals() == {}  # a GPU's stamped steps are a sample: no per-epoch totals


def test_an_empty_share_trains_nothing_on_the_gpu():
    """A DDP rank whose share of the last batch is empty still runs forward and backward, with
    channels_last images and the bf16 autocast the loop uses: every gradient defined and zero."""
    from pipeline.config import TrainConfig
    from pipeline.loop import DeviceSplit, share_loss, wrap_for_mode

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = build_model("small").to(device).to(memory_format=torch.channels_last)
    wrapped = wrap_for_mode(model, TrainConfig(), device, "single")
    images = torch.rand(8, 1, 28, 28, device=device).contiguous(memory_format=torch.channels_last)
    data = DeviceSplit(images, torch.zeros(8, dtype=torch.int64, device=device))
    idx = torch.arange(8, device=device)[7::8][1:]  # a strided, empty index, as rank_share makes it
    loss, sample_losses = share_loss(wrapped(data.images[idx]), data.labels[idx], 2, 2, Mnist().loss)
    loss.backward()
    assert sample_losses.item() == 0.0
    assert all(p.grad is not None and p.grad.abs().sum().item() == 0.0 for p in model.parameters())


def test_peak_memory_per_device():
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        torch.cuda.reset_peak_memory_stats(device)
        block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
        assert peak_memory_mb(device) >= 64
        del block


def test_nccl_commcheck_over_every_gpu(gpu_project):
    result = run(["mnist-pipeline", "commcheck"], gpu_project, **project_env(gpu_project))
    verdict = json.loads((gpu_project / "checks/comm.json").read_text())
    count = torch.cuda.device_count()
    assert verdict["backend"] == "nccl" and verdict["world_size"] == count and verdict["device"] == "cuda"
    assert verdict["devices"] == [torch.cuda.get_device_name(i) for i in range(count)]
    assert f"passed on {count} ranks (nccl)" in result.stdout


def test_single_on_the_gpu_trains_channels_last_and_saves_portable_files(gpu_project):
    train_cli(gpu_project, "single")
    summary = json.loads((gpu_project / "results/train/single.json").read_text())
    assert summary["device"] == "cuda"
    state = torch.load(gpu_project / "models/single/checkpoint.pt", weights_only=True)
    tensors = list(state["model"].values())
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def test_ddp_on_every_gpu_agrees_with_single(gpu_project):
    result = train_cli(gpu_project, "ddp")
    count = torch.cuda.device_count()
    assert f"launching {count} workers" in result.stdout
    summary = json.loads((gpu_project / "results/train/ddp.json").read_text())
    assert summary["backend"] == "nccl" and summary["world_size"] == count
    difference = relative_difference(load_weights(gpu_project, "single"), load_weights(gpu_project, "ddp"))
    print(f"relative |single - ddp| after 20 steps in float32 on {count} GPUs "
          f"({summary['batch_shares']}): {difference:.2e}")
    assert difference < FP32_RELATIVE_TOLERANCE


def test_compiled_ddp_on_every_gpu_agrees_with_compiled_single(tmp_path, mnist_dir):
    """train.compile on GPUs: Triton's kernels, built with this host's C compiler; compiled ddp over
    NCCL trains what compiled single trains, in float32 (the CPU's check: tests/test_compile.py)."""
    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "batch_size": 100, "nproc": 0,
                                                                   "bf16": False, "compile": True}})
    prepare(project, mnist_dir)
    for mode in ("single", "ddp"):
        result = train_cli(project, mode)
        said = result.stdout + result.stderr
        assert re.search(rf"{mode}: torch.compile \(train.compile\): [1-9]\d* graph\(s\) compiled", said), said[-2000:]
    difference = relative_difference(load_weights(project, "single"), load_weights(project, "ddp"))
    print(f"relative |single - ddp|, compiled, on {torch.cuda.device_count()} GPU(s): {difference:.2e}")
    assert difference < FP32_RELATIVE_TOLERANCE


def test_fsdp_on_every_gpu_agrees_with_ddp_and_reports_the_allocator_peak(gpu_project):
    """FSDP2 over NCCL on every GPU, float32 without TF32: ddp's weights to rounding, each rank 1/W
    of ddp's tensor bytes, each rank's allocator peak in the results (compare's table shows it), and
    its communication named unmeasured rather than 0 (its collectives run on streams of their own)."""
    train_cli(gpu_project, "ddp")
    train_cli(gpu_project, "fsdp")
    count = torch.cuda.device_count()
    difference = relative_difference(load_weights(gpu_project, "ddp"), load_weights(gpu_project, "fsdp"))
    print(f"relative |ddp - fsdp| on {count} GPU(s): {difference:.2e}")
    assert difference < FP32_RELATIVE_TOLERANCE
    ddp, fsdp = (json.loads((gpu_project / f"results/train/{mode}.json").read_text()) for mode in ("ddp", "fsdp"))
    assert fsdp["backend"] == "nccl" and fsdp["world_size"] == count
    if count > 1:
        assert fsdp["state_mb_per_rank"] < 0.6 * ddp["state_mb_per_rank"]
    for summary in (ddp, fsdp):  # the allocator's peak holds the state, and activations besides
        assert summary["peak_memory_mb_per_rank"] > summary["state_mb_per_rank"], summary
    if count > 1:
        ranks = json.loads((gpu_project / "results/breakdown/fsdp.json").read_text())["ranks"]
        assert all("fsdp on a GPU" in r["comm_unmeasured"] for r in ranks if "median_s" in r)


def test_dataparallel_over_every_gpu_agrees_with_single(gpu_project):
    train_cli(gpu_project, "dp")
    count = torch.cuda.device_count()
    assert json.loads((gpu_project / "results/train/dp.json").read_text())["dp_devices"] == count
    history = torch.load(gpu_project / "models/dp/checkpoint.pt", weights_only=True)["history"]
    assert all(history[-1][f"gpu{i}_peak_memory_mb"] > 0 for i in range(count))
    # The traced steps' kernels, GPU by GPU: each device a lane of the timeline.
    ranks = json.loads((gpu_project / "results/breakdown/dp.json").read_text())["ranks"]
    lanes = {bar["lane"] for rank in ranks for bar in rank["timeline"]}
    assert {f"GPU {i} kernels" for i in range(count)} <= lanes, sorted(lanes)
    difference = relative_difference(load_weights(gpu_project, "single"), load_weights(gpu_project, "dp"))
    print(f"relative |single - dp| after 20 steps in float32: {difference:.2e}")
    assert difference < FP32_RELATIVE_TOLERANCE


def test_bf16_keeps_float32_accuracy(gpu_project, tmp_path):
    """bf16's own check: the same budget, the validation accuracy float32 reaches (tests/tolerances.py)."""
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    train_cli(gpu_project, "ddp")  # float32, the project's setting
    fp32 = json.loads((gpu_project / "results/train/ddp.json").read_text())["val_accuracy"]
    bf16 = write_params(tmp_path / "bf16.yaml", data=SMALL["data"],
                        train={**SMALL["train"], "batch_size": 100, "nproc": 0, "bf16": True})
    train_cli(gpu_project, "ddp", "--params", str(bf16))
    accuracy = json.loads((gpu_project / "results/train/ddp.json").read_text())["val_accuracy"]
    print(f"ddp validation accuracy after 20 steps: bf16 {accuracy:.3f}, float32 {fp32:.3f}")
    assert abs(accuracy - fp32) < BF16_ACCURACY_TOLERANCE


def test_fp16_with_a_loss_scaler_learns_and_resumes_bit_for_bit_on_the_gpus(gpu_project, tmp_path):
    """train.fp16, for GPUs without native bf16 (V100, T4): fp16 autocast and torch.amp.GradScaler on
    CUDA. It learns, and a resume carries the loss scale: bit for bit. (lr 0.01: at 0.02, fp16 on
    the CPU's small slice collapsed at the one-cycle's peak.)"""
    fp16 = write_params(tmp_path / "fp16.yaml", data=SMALL["data"],
                        train={**SMALL["train"], "batch_size": 100, "nproc": 0, "bf16": False, "fp16": True,
                               "lr": 0.01})
    train_cli(gpu_project, "ddp", "--params", str(fp16))
    accuracy = json.loads((gpu_project / "results/train/ddp.json").read_text())["val_accuracy"]
    print(f"ddp validation accuracy after 20 steps in fp16: {accuracy:.3f}")
    assert accuracy > 0.5
    reference = load_weights(gpu_project, "ddp")
    scaler = torch.load(gpu_project / "models/ddp/checkpoint.pt", weights_only=True)["scaler"]
    crashed = train_cli(gpu_project, "ddp", "--params", str(fp16), check=False, MNIST_PIPELINE_CRASH_AFTER_EPOCH="1")
    assert crashed.returncode != 0
    train_cli(gpu_project, "ddp", "--params", str(fp16), "--resume")
    assert max_abs_diff(reference, load_weights(gpu_project, "ddp")) == 0.0
    # The scale, and its count of clean steps towards the next doubling, went on from the checkpoint.
    assert torch.load(gpu_project / "models/ddp/checkpoint.pt", weights_only=True)["scaler"] == scaler


@pytest.mark.parametrize("mode", ["single", "dp", "ddp"])
def test_a_training_read_by_dataloaders_is_the_in_memory_one_bit_for_bit_on_the_gpus(gpu_project, tmp_path, mode):
    """train.loader: dataloader on GPUs: batches pinned by the workers, copied asynchronously, then
    normalised on the device, as the in-memory path normalises (a GPU divides by a number otherwise
    than a CPU), in channels_last: the same weights as the in-memory training, bit for bit."""
    train_cli(gpu_project, mode)
    reference = load_weights(gpu_project, mode)
    loaded = write_params(tmp_path / "loaded.yaml", data=SMALL["data"],
                          train={**SMALL["train"], "batch_size": 100, "nproc": 0, "bf16": False,
                                 "loader": "dataloader"})
    result = train_cli(gpu_project, mode, "--params", str(loaded))
    assert "by DataLoaders" in result.stderr
    assert max_abs_diff(reference, load_weights(gpu_project, mode)) == 0.0


@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_a_resume_on_the_gpu_ends_with_the_uninterrupted_weights_bit_for_bit(gpu_project, mode):
    """train.deterministic (on by default): cuDNN and cuBLAS take the same path on every run."""
    train_cli(gpu_project, mode)
    reference = load_weights(gpu_project, mode)
    train_cli(gpu_project, mode)
    assert max_abs_diff(reference, load_weights(gpu_project, mode)) == 0.0  # two identical runs
    crashed = train_cli(gpu_project, mode, check=False, MNIST_PIPELINE_CRASH_AFTER_EPOCH="1")
    assert crashed.returncode != 0
    train_cli(gpu_project, mode, "--resume")
    assert max_abs_diff(reference, load_weights(gpu_project, mode)) == 0.0


@pytest.mark.parametrize("mode", ["single", "dp", "ddp"])
def test_a_run_on_the_gpus_is_reproduced_bit_for_bit_from_its_record(gpu_project, mode):
    """train.deterministic (on by default): `mnist-pipeline reproduce` re-makes the mode's run on
    the same GPUs, from its MLflow record alone, with the same weights."""
    train_cli(gpu_project, mode)
    original = json.loads((gpu_project / "models" / mode / "mlflow_run.json").read_text())["parent"]
    proc = run(["mnist-pipeline", "reproduce", original], gpu_project, check=False, **project_env(gpu_project))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reproduced bit for bit" in proc.stdout


def test_the_driver_version_is_recorded_as_the_driver_says():
    """The kernel module's own line (proprietary or open: "... Open Kernel Module for x86_64  580.xx"),
    read as NVML reads the driver; and every GPU here one these wheels have kernels for, as torch's
    own check says (no "not compatible" warning)."""
    from pipeline import gpus
    from pipeline.record import driver_version

    driver = gpus.driver_gpus()
    assert isinstance(driver, tuple), driver
    assert driver_version() == driver[1]
    for index in range(torch.cuda.device_count()):
        assert gpus.runs_here(torch.cuda.get_device_capability(index), torch.cuda.get_arch_list())


def test_sync_batchnorm_makes_a_batchnorm_model_on_every_gpu_agree_with_single(tmp_path, mnist_dir):
    """train.sync_batchnorm: the image workload's BatchNorm layers normalise by the global batch's
    statistics on every rank, as single does over the whole batch: the weights agree to rounding.
    Without it each rank normalises its own share (tests/test_image_workload.py shows the gap on
    the CPU, where torch's SyncBatchNorm does not run)."""
    from tests.test_image_workload import PARAMS, image_folder

    if torch.cuda.device_count() < 2:
        pytest.skip("SyncBatchNorm syncs across ranks: two GPUs at least")
    workload = {**PARAMS["workload"], "init_args": {**PARAMS["workload"]["init_args"], "norm": "batch"}}
    project = make_project(tmp_path / "proj", {**PARAMS, "workload": workload,
                                               "train": {**PARAMS["train"], "nproc": 0, "bf16": False,
                                                         "sync_batchnorm": True}})
    image_folder(project / "data/images", mnist_dir, per_class=60)
    run(["mnist-pipeline", "prepare"], project, **project_env(project))
    for mode in ("single", "ddp"):
        train_cli(project, mode)
    difference = relative_difference(load_weights(project, "single"), load_weights(project, "ddp"))
    print(f"relative |single - ddp| with SyncBatchNorm on {torch.cuda.device_count()} GPUs: {difference:.2e}")
    assert difference < FP32_RELATIVE_TOLERANCE
