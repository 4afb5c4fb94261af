"""End to end: `dvc repro prepare` in a temporary git repo holding a copy of the project."""

import json

import torch

from pipeline.mnist import CANONICAL_MD5
from tests.conftest import make_project, project_env, run


def test_dvc_repro_prepare(tmp_path, mnist_dir):
    project = make_project(tmp_path / "proj", {"data": {"train_limit": 3000, "val_size": 500}})
    env = project_env(project, MNIST_SOURCE=str(mnist_dir))
    first = run(["dvc", "repro", "prepare"], project, **env)
    assert "Running stage 'prepare'" in first.stdout

    out = project / "data" / "prepared"
    stats = json.loads((out / "stats.json").read_text())
    for name, count in (("train", 2500), ("val", 500), ("test", 10000)):
        blob = torch.load(out / f"{name}.pt", weights_only=True)
        assert blob["images"].dtype == torch.uint8 and blob["labels"].dtype == torch.int64
        assert stats["splits"][name]["count"] == len(blob["labels"]) == count
        assert stats["splits"][name]["class_counts"] == torch.bincount(blob["labels"], minlength=10).tolist()
    train = torch.load(out / "train.pt", weights_only=True)["images"].double() / 255
    assert abs(stats["train_pixel_mean"] - train.mean().item()) < 1e-6
    assert abs(stats["train_pixel_std"] - train.std().item()) < 1e-6
    assert stats["checksums_verified"] is True
    assert {v["md5"] for v in stats["sources"].values()} == set(CANONICAL_MD5.values())

    second = run(["dvc", "repro", "prepare"], project, **env)
    assert "didn't change, skipping" in second.stdout and "Running stage" not in second.stdout
    status = run(["dvc", "status", "prepare"], project, **env)
    assert "up to date" in status.stdout

    # Beyond one machine: the prepared data goes to a DVC remote that every node pulls from (here a
    # directory remote, as on a shared file system); a node's fresh clone gets the same bytes.
    remote = tmp_path / "dvc-remote"
    run(["dvc", "remote", "add", "--default", "shared", str(remote)], project, **env)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    run([*git, "add", "-A"], project)
    run([*git, "commit", "-qm", "prepared data on the shared remote"], project)
    run(["dvc", "push", "prepare"], project, **env)
    node = tmp_path / "node"
    run(["git", "clone", "-q", str(project), str(node)], tmp_path)
    pulled = run(["dvc", "pull", "prepare"], node, **project_env(node))
    assert "files fetched" in pulled.stdout or "added" in pulled.stdout, pulled.stdout
    for name in ("train.pt", "val.pt", "test.pt", "stats.json"):
        assert (node / "data/prepared" / name).read_bytes() == (out / name).read_bytes()
    assert "up to date" in run(["dvc", "status", "prepare"], node, **project_env(node)).stdout
