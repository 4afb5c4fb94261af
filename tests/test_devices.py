"""Which device trains: train.device, and a driver too old for this torch's CUDA."""

import warnings
from pathlib import Path

import pytest
import torch

from pipeline import parallel
from pipeline.errors import PipelineError
from pipeline.parallel import Rank

# c10/cuda/CUDAFunctions.cpp's message, as torch's device count warns it (both parts are checked
# against the library below, so a torch that words it otherwise fails here first).
TOO_OLD = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12020). Please update "
           "your GPU driver by downloading and installing a new version from the URL: "
           "http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org to install a "
           "PyTorch version that has been compiled with your version of the CUDA driver.")


def test_torch_words_an_old_driver_as_the_check_expects():
    library = (Path(torch.__file__).parent / "lib" / "libc10_cuda.so").read_bytes()
    assert b"CUDA initialization: " in library
    assert b"The NVIDIA driver on your system is too old (found version " in library


def test_a_driver_too_old_is_an_error_naming_both_versions(monkeypatch):
    """torch warns and reports no GPU; training would go to the CPU. The pipeline refuses."""
    def device_count() -> int:
        warnings.warn(TOO_OLD, UserWarning)
        return 0

    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    parallel.cuda_device_count.cache_clear()
    try:
        with pytest.raises(PipelineError, match=r"the NVIDIA driver supports CUDA 12\.2, but this torch .* built for "
                                                r"CUDA 13\.0, which needs driver 580 or newer: update the driver"):
            parallel.pick_device(Rank(), "auto")
        assert parallel.pick_device(Rank(), "cpu").type == "cpu"  # asked for the CPU: no GPU question
        assert parallel.default_nproc("cpu") == parallel.CPU_ONLY_DEFAULT_NPROC
    finally:
        parallel.cuda_device_count.cache_clear()


def test_other_cuda_warnings_still_reach_the_user(monkeypatch):
    def device_count() -> int:
        warnings.warn("CUDA initialization: something else", UserWarning)
        return 0

    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    parallel.cuda_device_count.cache_clear()
    try:
        with pytest.warns(UserWarning, match="something else"):
            assert parallel.pick_device(Rank(), "auto").type == "cpu"
    finally:
        parallel.cuda_device_count.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host: auto picks its GPU")
def test_cuda_without_a_gpu_is_an_error_and_auto_is_the_cpu():
    assert parallel.pick_device(Rank(), "auto").type == "cpu"
    with pytest.raises(PipelineError, match="rank 3: train.device is cuda, but no GPU is visible"):
        parallel.pick_device(Rank(rank=3, local_rank=1, world_size=4, local_world_size=2), "cuda")
