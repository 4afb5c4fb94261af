"""The same inputs give the same weights, bit for bit, on GPUs too.

On the CPU the loop's ops are deterministic already. On CUDA they are not by default: cuDNN picks
convolution algorithms by timing them (`benchmark`) and some of its backward algorithms add with
atomics, and cuBLAS splits its work by a workspace that changes between runs. Then a resume would
not end with the uninterrupted weights, and two identical runs would differ.
"""

from __future__ import annotations

import os

import torch

# cuBLAS is deterministic with a fixed workspace; torch refuses a cuBLAS call under deterministic
# algorithms unless this is set before the call (torch.use_deterministic_algorithms' docs).
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_algorithms(enabled: bool) -> None:
    """Deterministic algorithms everywhere (`train.deterministic`), before any CUDA work.

    torch then raises on an op that has no deterministic form on the device, naming it, instead of
    training on a silently irreproducible one. None of the loop's ops is such an op in torch 2.14
    (its list: pooling backward in 3-d and adaptive forms, 2-d NLL loss, scatter/index ops on
    CUDA; here 2-d max pooling, 1-d cross-entropy, convolutions and linear layers)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False  # timing-based choices differ from run to run
