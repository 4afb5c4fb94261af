"""Whether this process has initialised the NVIDIA driver, asked without initialising it.

A process forked after the driver was initialised (cuInit, which torch.cuda.is_available() and
every CUDA call reach; nvmlInit) cannot use the GPUs, so the servers that fork (pipeline/runtime/warm_server.py,
pipeline/runtime/forkserver.py) must not have done it. That the driver's library is merely loaded says
nothing: on a GPU host `import torch` maps libcuda.so.1 (cuBLASLt and cuSPARSELt dlopen it when
they load) and calls nothing in it. The driver itself answers without initialising: before cuInit,
cuDeviceGetCount returns CUDA_ERROR_NOT_INITIALIZED, and before nvmlInit, nvmlDeviceGetCount_v2
returns NVML_ERROR_UNINITIALIZED. A library not loaded at all (dlopen with RTLD_NOLOAD) was not
initialised either. tests/test_warm.py runs this against a stand-in libcuda.so.1 that logs each call.

Imports only the standard library.
"""

from __future__ import annotations

import ctypes
import os

CUDA_ERROR_NOT_INITIALIZED = 3
NVML_ERROR_UNINITIALIZED = 1
# (library, the call that answers without initialising, what it answers before initialisation)
QUERIES = (("libcuda.so.1", "cuDeviceGetCount", CUDA_ERROR_NOT_INITIALIZED),
           ("libnvidia-ml.so.1", "nvmlDeviceGetCount_v2", NVML_ERROR_UNINITIALIZED))


def initialised() -> list[str]:
    """The driver libraries this process has initialised (empty: fit to fork)."""
    found = []
    for name, call, before_init in QUERIES:
        try:
            library = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only if already loaded
        except OSError:
            continue  # not loaded: nothing initialised it
        query = getattr(library, call, None)
        count = ctypes.c_uint()
        if query is None or query(ctypes.byref(count)) != before_init:
            found.append(name)  # initialised (or a library we cannot ask: counted as initialised)
    return found
