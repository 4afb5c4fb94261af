import gzip
import hashlib
import shutil

import pytest
import torch
from click.testing import CliRunner

from pipeline import mnist
from pipeline.config import DataConfig
from pipeline.errors import DataError
from pipeline.prepared import split_train_val
from stages.cli import main
from tests.conftest import idx_bytes, write_params, write_tiny_mnist

TRAIN_CLASS_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


@pytest.mark.fast
def test_real_mnist_facts(mnist_dir):
    train, files = mnist.read_split(mnist_dir, "train", verify=True)
    test, _ = mnist.read_split(mnist_dir, "test", verify=True)
    assert train.images.shape == (60000, 28, 28) and train.images.dtype == torch.uint8
    assert test.images.shape == (10000, 28, 28) and test.images.dtype == torch.uint8
    assert train.labels.dtype == torch.int64 and train.labels.shape == (60000,)
    assert train.labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert test.labels[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert torch.bincount(train.labels).tolist() == TRAIN_CLASS_COUNTS
    assert [f.md5 for f in files] == [mnist.CANONICAL_MD5[n] for n in mnist.SPLIT_FILES["train"]]


@pytest.mark.fast
def test_raw_and_gzip_read_the_same(tmp_path):
    raw_dir = write_tiny_mnist(tmp_path / "raw")
    gz_dir = tmp_path / "gz"
    gz_dir.mkdir()
    for path in raw_dir.iterdir():
        (gz_dir / f"{path.name}.gz").write_bytes(gzip.compress(path.read_bytes()))
    a, _ = mnist.read_split(raw_dir, "train", verify=False)
    b, _ = mnist.read_split(gz_dir, "train", verify=False)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert a.images.shape == (40, 28, 28)


def _expect(folder, fragments, verify=False):
    with pytest.raises(DataError) as info:
        mnist.read_split(folder, "train", verify=verify)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.fast
def test_missing_file(tmp_path):
    folder = write_tiny_mnist(tmp_path)
    (folder / "train-labels-idx1-ubyte").unlink()
    _expect(folder, ["missing train-labels-idx1-ubyte", "MNIST_SOURCE"])


@pytest.mark.fast
def test_wrong_magic(tmp_path):
    folder = write_tiny_mnist(tmp_path)
    path = folder / "train-images-idx3-ubyte"
    path.write_bytes(idx_bytes([0] * 40 * 28 * 28, (40, 28 * 28)))  # 2 dims where 3 belong
    _expect(folder, [str(path), "wrong magic number 0x00000802", "expected 0x00000803"])


@pytest.mark.fast
def test_truncated(tmp_path):
    folder = write_tiny_mnist(tmp_path)
    path = folder / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    _expect(folder, [str(path), "truncated", "(40, 28, 28)"])


@pytest.mark.fast
def test_truncated_gzip_stream(tmp_path):
    folder = write_tiny_mnist(tmp_path)
    path = folder / "train-images-idx3-ubyte"
    packed = gzip.compress(path.read_bytes())
    path.unlink()
    (folder / "train-images-idx3-ubyte.gz").write_bytes(packed[: len(packed) // 2])
    _expect(folder, ["train-images-idx3-ubyte.gz", "not a readable gzip file"])


@pytest.mark.fast
def test_count_mismatch(tmp_path):
    folder = write_tiny_mnist(tmp_path)
    (folder / "train-labels-idx1-ubyte").write_bytes(idx_bytes([1] * 39, (39,)))
    _expect(folder, ["40 images", "39 labels", "must match"])


@pytest.mark.fast
def test_checksum_mismatch(tmp_path, mnist_dir):
    folder = tmp_path / "mnist"
    shutil.copytree(mnist_dir, folder)
    labels = folder / "train-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(labels.read_bytes()))
    raw[8] = (raw[8] + 1) % 10  # one wrong label, same length and header
    labels.write_bytes(gzip.compress(bytes(raw)))
    _expect(folder, [str(labels), "checksum mismatch", hashlib.md5(raw).hexdigest(),
                     mnist.CANONICAL_MD5["train-labels-idx1-ubyte"], "verify_checksums: false"], verify=True)
    split, _ = mnist.read_split(folder, "train", verify=False)  # custom data: turned off, it loads
    assert len(split.labels) == 60000


@pytest.mark.fast
def test_split_is_seeded_and_disjoint(tmp_path):
    train, _ = mnist.read_split(write_tiny_mnist(tmp_path, n_train=100), "train", verify=False)
    config = DataConfig(seed=1, val_size=10, train_limit=50)
    a_train, a_val = split_train_val(train, config)
    b_train, b_val = split_train_val(train, config)
    assert torch.equal(a_val.images, b_val.images)
    assert len(a_train.labels) == 40 and len(a_val.labels) == 10
    _, c_val = split_train_val(train, DataConfig(seed=2, val_size=10, train_limit=50))
    assert not torch.equal(a_val.images, c_val.images)


@pytest.mark.fast
def test_prepare_cli_bad_input_exits_nonzero_and_writes_nothing(tmp_path, monkeypatch):
    folder = write_tiny_mnist(tmp_path / "src")
    (folder / "t10k-images-idx3-ubyte").write_bytes(b"\x00\x00\x08")
    params = tmp_path / "params.yaml"
    write_params(params, data={"verify_checksums": False, "val_size": 10})
    out = tmp_path / "prepared"
    monkeypatch.setenv("MNIST_SOURCE", str(folder))
    result = CliRunner().invoke(main, ["prepare", "--params", str(params), "--out", str(out)])
    assert result.exit_code == 1
    assert "t10k-images-idx3-ubyte: truncated" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "src"]  # no output, no temp


def test_prepare_cli_missing_source_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MNIST_SOURCE", str(tmp_path / "nowhere"))
    params = tmp_path / "params.yaml"
    write_params(params)
    result = CliRunner().invoke(main, ["prepare", "--params", str(params), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "no such folder" in result.output


def test_prepare_into_an_unwritable_folder_is_a_clear_error(tmp_path, monkeypatch):
    import os

    if os.geteuid() == 0:
        # root writes anywhere; a file where a parent folder goes makes the output impossible instead
        (tmp_path / "blocked").write_text("")
        out = tmp_path / "blocked" / "prepared"
        expected = f"{tmp_path / 'blocked'}: a file is in the way"
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        out = tmp_path / "ro" / "prepared"
        expected = "cannot write into"
    folder = write_tiny_mnist(tmp_path / "src")
    params = tmp_path / "params.yaml"
    write_params(params, data={"verify_checksums": False, "val_size": 10})
    monkeypatch.setenv("MNIST_SOURCE", str(folder))
    result = CliRunner().invoke(main, ["prepare", "--params", str(params), "--out", str(out)])
    assert result.exit_code == 1 and expected in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_the_tests_take_mnist_from_mnist_source_raw_or_gzipped(tmp_path):
    """A GPU host runs `make gpu-check` with MNIST_SOURCE pointing at its own copy, often raw files."""
    from tests.conftest import MNIST_DIR, find_mnist, write_tiny_mnist

    raw = write_tiny_mnist(tmp_path / "raw")
    assert find_mnist({"MNIST_SOURCE": str(raw)}) == raw
    assert find_mnist({}) == MNIST_DIR
    with pytest.raises(pytest.fail.Exception, match=r"missing train-images-idx3-ubyte .*set MNIST_SOURCE"):
        find_mnist({"MNIST_SOURCE": str(tmp_path / "empty")})
