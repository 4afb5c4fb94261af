"""The built-in image workload (pipeline.workloads.images): a folder of images on disk in
ImageFolder's layout, written here from MNIST's test images as PNGs, read by DataLoader workers and
augmented per sample under seeds of (train.seed, epoch, index), so that which worker, rank or mode
reads a sample changes nothing."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from pipeline.batches import AUGMENTED_IN_MEMORY, split_of
from pipeline.checkpoint import settings_changed, trajectory
from pipeline.config import DataConfig, WorkloadConfig
from pipeline.errors import ConfigError, DataError
from pipeline.loop import DeviceSplit, Training, settle_gradient_buckets, train, wrap_for_mode
from pipeline.mnist import read_split
from pipeline.parallel import Rank, check_every_mode
from pipeline.workloads import check_workload, load_workload
from pipeline.workloads.images import ImageFolderClassifier
from tests.conftest import SMALL, load_weights, make_project, project_env, relative_difference, run, train_cli
from tests.ddp_harness import rank_dir, run_ranks, train_config

CPU = torch.device("cpu")


def image_folder(root: Path, mnist: Path, classes: int = 3, per_class: int = 40) -> Path:
    """root/digit<d>/<n>.png: MNIST test images of the first `classes` digits, written by Pillow
    (not by the code under test), one as a JPEG."""
    from PIL import Image

    split, _ = read_split(mnist, "test", verify=False)
    for digit in range(classes):
        (root / f"digit{digit}").mkdir(parents=True)
        for n, i in enumerate((split.labels == digit).nonzero().flatten()[:per_class].tolist()):
            suffix = "jpg" if (digit, n) == (0, 0) else "png"
            Image.fromarray(split.images[i].numpy()).save(root / f"digit{digit}" / f"{n}.{suffix}")
    return root


def workload(root: Path, **init_args) -> ImageFolderClassifier:
    return ImageFolderClassifier(str(root), **{"classes": 3, "image_size": 16, "channels": 1, **init_args})


@pytest.mark.fast
def test_augmentation_is_seeded_per_sample_and_epoch_whatever_reads_it(tmp_path, mnist_dir):
    images = workload(image_folder(tmp_path / "images", mnist_dir, per_class=12))
    check_workload(images, WorkloadConfig("pipeline.workloads.images.ImageFolderClassifier", {}))
    out = tmp_path / "prepared"
    out.mkdir()
    assert images.prepare(out, tmp_path, DataConfig(seed=1)) == f"{tmp_path / 'images'} (36 images, 3 classes)"
    stats = json.loads((out / "stats.json").read_text())
    assert stats["classes"] == ["digit0", "digit1", "digit2"] and stats["splits"]["train"]["count"] == 28
    train = images.split(out, "train")
    assert train.dataset[0][0].shape == (1, 16, 16) and train.augment is not None
    assert images.split(out, "val").augment is None  # validation and test: as they are

    # Rank 1's share of a batch, then sample 5 in another batch: each read draws the sample's own.
    parts = [torch.arange(10), torch.tensor([5, 3])]
    rng = torch.get_rng_state()
    reads = {}
    for workers, epoch in ((0, 1), (2, 1), (0, 2), (0, None)):
        loaded = split_of(train, CPU, "dataloader", workers, seed=42)
        reads[workers, epoch] = [inputs for inputs, _ in loaded.feed(iter(parts), epoch=epoch)]
        loaded.close()
    assert torch.equal(torch.get_rng_state(), rng)  # read in this process: its generator as it was
    once = reads[0, 1]
    assert all(torch.equal(a, b) for a, b in zip(once, reads[2, 1]))  # workers read what this process reads
    assert torch.equal(once[0][5], once[1][0])  # the sample, not the batch or its place, decides
    assert not torch.equal(once[0], reads[0, 2][0])  # each epoch anew
    plain = images.split(out, "train").on_device(torch.stack([train.dataset[i][0] for i in range(10)]))
    assert torch.equal(reads[0, None][0], plain) and not torch.equal(once[0], plain)  # no epoch: as stored
    assert split_of(train, CPU, "memory", 0, seed=None) is not None  # no seed: not the training split
    # Python's random too (torchvision's RandomChoice draws from it), put back as it was.
    by_python = dataclasses.replace(train, augment=lambda image: image // 2 + random.randrange(100))
    state = random.getstate()
    drawn = {}
    for workers in (0, 2):
        loaded = split_of(by_python, CPU, "dataloader", workers, seed=42)
        drawn[workers] = [inputs for inputs, _ in loaded.feed(iter(parts), epoch=1)]
        loaded.close()
    assert random.getstate() == state
    assert all(torch.equal(a, b) for a, b in zip(drawn[0], drawn[2])) and torch.equal(drawn[0][0][5], drawn[0][1][0])
    with pytest.raises(ConfigError, match=AUGMENTED_IN_MEMORY):
        split_of(train, CPU, "memory", 0, seed=42)

    # Prepared for other init_args: said, not read as if it fit.
    with pytest.raises(DataError, match="not these workload.init_args"):
        workload(tmp_path / "images", image_size=24).split(out, "train")


@pytest.mark.fast
def test_prepare_skips_hidden_folders_and_refuses_images_it_would_clip(tmp_path, mnist_dir):
    from PIL import Image

    root = image_folder(tmp_path / "images", mnist_dir, per_class=4)
    (root / ".ipynb_checkpoints").mkdir()  # not a class
    (root / ".ipynb_checkpoints" / "a.png").write_bytes((root / "digit0" / "1.png").read_bytes())
    wide = root / "digit2" / "wide.png"
    Image.fromarray(torch.arange(0, 65536, 64, dtype=torch.int32).reshape(32, 32).numpy().astype("uint16")).save(wide)
    assert Image.open(wide).mode.startswith("I;16")
    images = workload(root, val_fraction=0.25, test_fraction=0.25)
    with pytest.raises(DataError, match="wide.png: a 16-bit image .* save it with 8 bits a channel"):
        images.prepare(_empty(tmp_path / "a"), tmp_path, DataConfig(seed=1))
    wide.unlink()
    assert "(12 images, 3 classes)" in images.prepare(_empty(tmp_path / "b"), tmp_path, DataConfig(seed=1))
    with pytest.raises(DataError, match="no such folder"):
        workload(tmp_path / "nothing").prepare(_empty(tmp_path / "c"), tmp_path, DataConfig(seed=1))


def _empty(folder: Path) -> Path:
    folder.mkdir()
    return folder


PARAMS = {**SMALL, "data": {"seed": 3},
          "workload": {"class_path": "pipeline.workloads.images.ImageFolderClassifier",
                       "init_args": {"root": "data/images", "classes": 3, "image_size": 16, "channels": 1}},
          "train": {**SMALL["train"], "modes": ["single", "ddp"], "batch_size": 16, "epochs": 3, "lr": 0.01,
                    "loader": "dataloader",
                    "loader_workers": 1},
          "evaluate": {"batch_size": 50, "min_test_accuracy": 0.5}}


def test_a_folder_of_images_is_prepared_trained_augmented_and_evaluated_by_the_stages(tmp_path, mnist_dir):
    """prepare refuses a file that is not an image (naming it, writing nothing), then writes the
    splits; train.loader: memory is refused for augmented data; single and 2-rank ddp train on
    augmented samples and agree to rounding; evaluate scores the classifier, confusion included."""
    project = make_project(tmp_path / "proj", PARAMS)
    image_folder(project / "data/images", mnist_dir, per_class=60)
    broken = project / "data/images/digit1/broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    refused = run(["mnist-pipeline", "prepare"], project, check=False, **project_env(project))
    assert refused.returncode == 1 and "data/images/digit1/broken.png: not an image Pillow reads" in \
        refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (project / "data/prepared").exists()
    broken.unlink()
    said = run(["mnist-pipeline", "prepare"], project, **project_env(project)).stdout
    assert "prepared train 144, val 18, test 18 from data/images (180 images, 3 classes)" in said, said

    params = project / "params.yaml"
    text = params.read_text()
    params.write_text(text.replace("loader: dataloader", "loader: memory"))
    in_memory = train_cli(project, "single", check=False)
    assert in_memory.returncode == 1 and AUGMENTED_IN_MEMORY in in_memory.stderr, in_memory.stderr
    assert "Traceback" not in in_memory.stderr
    assert [p.name for p in (project / "models").rglob("*") if p.is_file()] == [".train.lock"]  # the stage's lock
    params.write_text(text)

    for mode in ("single", "ddp"):
        train_cli(project, mode)
    single, ddp = load_weights(project, "single"), load_weights(project, "ddp")
    assert relative_difference(single, ddp) < 1e-3  # GroupNorm: per sample, so the shares add up

    run(["mnist-pipeline", "evaluate"], project, **project_env(project))
    scores = json.loads((project / "results/eval/ddp.json").read_text())
    assert scores["count"] == 18 and scores["accuracy"] > 0.5, scores  # it learns: chance is 1/3
    assert scores["per_class_accuracy"].keys() == {"0", "1", "2"}


def small_images(n: int, seed: int) -> DeviceSplit:
    """Grey 16x16 images whose label is the brightest of the first three quarters."""
    images = torch.rand(n, 1, 16, 16, generator=torch.Generator().manual_seed(seed))
    return DeviceSplit(images, images.reshape(n, 2, 8, 2, 8).mean((2, 4)).flatten(1)[:, :3].argmax(1))


def resnet(norm: str) -> WorkloadConfig:
    return WorkloadConfig("pipeline.workloads.images.ImageFolderClassifier",
                          {"root": "unused", "classes": 3, "image_size": 16, "channels": 1, "norm": norm})


def _ddp_each_norm(r: int, world: int, runs: list[tuple[str, str, bool]], train_split: DeviceSplit,
                   val_split: DeviceSplit, out: Path) -> None:
    """Rank r of each (norm, mode, train.sync_batchnorm) training in turn; rank 0 saves its weights
    as out/<norm>[-fsdp][-sync].pt."""
    for norm, mode, synced in runs:
        config = dataclasses.replace(train_config(16, epochs=2), sync_batchnorm=synced)
        name = f"{norm}{'-fsdp' if mode == 'fsdp' else ''}{'-sync' if synced else ''}"
        run = Training(config, mode, Rank(r, r, world, world), CPU, rank_dir(out / name, r), workload=resnet(norm))
        model, _ = train(run, train_split, val_split)
        if r == 0:
            torch.save(model.state_dict(), out / f"{name}.pt")


def test_group_norm_and_sync_batch_norm_keep_single_equal_to_ddp_and_batch_norm_does_not(tmp_path):
    """Said in docs/workloads.md: GroupNorm normalises each sample alone, so 2 DDP ranks add up to
    one device; BatchNorm normalises each rank's share by its own statistics, another function, the
    same under fsdp as under ddp; with train.sync_batchnorm, DDP's BatchNorm takes the global
    batch's statistics again (the CPU's SyncBatchNorm, pipeline.gloo_batchnorm), at 2 ranks and at 3,
    whose shares of 16 are uneven (6, 5, 5), running statistics included."""
    train_split, val_split = small_images(96, 0), small_images(20, 1)
    run_ranks(2, _ddp_each_norm, [("group", "ddp", False), ("batch", "ddp", False), ("batch", "fsdp", False),
                                  ("batch", "ddp", True)], train_split, val_split, tmp_path / "2")
    run_ranks(3, _ddp_each_norm, [("batch", "ddp", True)], train_split, val_split, tmp_path / "3")
    single = {}
    for norm in ("group", "batch"):
        run = Training(train_config(16, epochs=2), "single", Rank(), CPU, tmp_path / f"single-{norm}",
                       workload=resnet(norm))
        single[norm] = train(run, train_split, val_split)[0].state_dict()
    assert relative_difference(single["group"], torch.load(tmp_path / "2/group.pt", weights_only=True)) < 1e-4
    assert relative_difference(single["batch"], torch.load(tmp_path / "2/batch.pt", weights_only=True)) > 1e-3
    for world in (2, 3):
        synced = torch.load(tmp_path / f"{world}/batch-sync.pt", weights_only=True)
        assert synced.keys() == single["batch"].keys() and any("running_var" in key for key in synced)
        apart = relative_difference(single["batch"], synced)
        assert apart < 1e-4, (world, apart)
    # fsdp, its ResNet blocks sharded one by one, trains what ddp trains, BatchNorm's statistics too
    # (rank 0's, sent to every rank before each training forward, as DDP sends them).
    ddp, fsdp = (torch.load(tmp_path / f"2/{name}.pt", weights_only=True) for name in ("batch", "batch-fsdp"))
    assert any("running_mean" in key for key in fsdp) and relative_difference(ddp, fsdp) < 1e-4


@pytest.mark.fast
def test_the_cpus_sync_batchnorm_is_batch_norm_over_the_process_group_and_part_of_the_trajectory(tmp_path):
    """pipeline.gloo_batchnorm in a process group of one: what BatchNorm computes, forward, backward
    and running statistics, in training and in evaluation, with the same state_dict; the 2- and
    3-rank trainings above show the sums crossing ranks. Refused with accumulation, not on CPUs."""
    import copy

    import torch.distributed as dist

    from pipeline import gloo_batchnorm

    synced = dataclasses.replace(train_config(16), sync_batchnorm=True, device="cpu")
    check_every_mode(synced)  # the CPU has a SyncBatchNorm now: ddp in train.modes trains with it
    with pytest.raises(ConfigError, match="train.sync_batchnorm is true with train.grad_accum_steps = 2"):
        check_every_mode(dataclasses.replace(synced, grad_accum_steps=2))
    batch_norm = ImageFolderClassifier("unused", classes=3, image_size=16, channels=1, norm="batch").build_model()
    converted = gloo_batchnorm.convert(copy.deepcopy(batch_norm), CPU)
    layers = [m for m in converted.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert layers and all(type(m) is gloo_batchnorm.GlooSyncBatchNorm for m in layers)
    assert converted.state_dict().keys() == batch_norm.state_dict().keys()
    images = torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        for model in (batch_norm, converted):
            model.train()
            model(images).square().sum().backward()
            model(images * 2).sum().backward()  # a second step's statistics: the running average
        expected = dict(batch_norm.named_parameters())
        for name, parameter in converted.named_parameters():
            torch.testing.assert_close(parameter.grad, expected[name].grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(converted.state_dict(), batch_norm.state_dict(), rtol=1e-5, atol=1e-6)
        batch_norm.eval(), converted.eval()
        torch.testing.assert_close(converted(images), batch_norm(images))
        # Under fp16 autocast (train.fp16) the statistics stay float32: the squares of 128 images of
        # 28x28 pass fp16's largest number; a layer without a bias (torch's `bias=False`) too.
        big = torch.randn(128, 3, 28, 28, generator=torch.Generator().manual_seed(1)) * 3
        plain = torch.nn.BatchNorm2d(3, bias=False)
        synced_layer = gloo_batchnorm.convert(torch.nn.Sequential(copy.deepcopy(plain)), CPU)[0]
        with torch.autocast("cpu", dtype=torch.float16):
            expected, got = plain(big.half()), synced_layer(big.half())
        assert got.dtype == torch.float16 and synced_layer.running_var.isfinite().all()
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(synced_layer.running_var, plain.running_var)
    finally:
        dist.destroy_process_group()
    # Not compiled on the CPU (a host sync in every layer): refused at start, and on a Slurm node.
    with pytest.raises(ConfigError, match="train.sync_batchnorm and train.compile are both true"):
        check_every_mode(dataclasses.replace(synced, compile=True))
    check_every_mode(dataclasses.replace(synced, compile=True, modes=("single", "fsdp")))  # no ddp: nothing to sync
    with pytest.raises(ConfigError, match="train.sync_batchnorm and train.compile are both true"):
        wrap_for_mode(batch_norm, dataclasses.replace(synced, compile=True), CPU, "ddp")
    # ddp's alone: a single or dp checkpoint goes on whatever it says.
    assert trajectory(synced, "single") == trajectory(train_config(16), "single")
    # A checkpoint trained without it is not continued with it; one from before the setting was without it.
    plain = trajectory(train_config(16), "ddp")
    assert settings_changed({"trajectory": plain}, trajectory(synced, "ddp")) == "sync_batchnorm: False -> True"
    before = {key: value for key, value in plain.items() if key != "sync_batchnorm"}
    assert settings_changed({"trajectory": before}, plain) == ""


@pytest.mark.fast
def test_the_warm_up_backward_leaves_batch_norms_statistics_as_they_were():
    """settle_gradient_buckets runs one forward in training mode on every DDP rank, fresh or
    resumed; batch norm's running statistics must not move with it, or ddp's would differ from
    single's, and a resumed training from an uninterrupted one."""
    model = load_workload(resnet("batch")).build_model()
    data = small_images(8, 0)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    settle_gradient_buckets(model, data)
    assert all(torch.equal(buffer, before[name]) for name, buffer in model.named_buffers())
    model(data.sample_input())  # what it would have left: a forward in training mode moves them
    assert not torch.equal(dict(model.named_buffers())["stem.1.running_mean"], before["stem.1.running_mean"])
