"""train.compile: torch.compile (TorchInductor) over the model each mode trains, and the checks that
it can run, made before anything on disk changes.

Forwards are compiled in place: the same modules, their parameters, state_dict keys and hooks
unchanged (DDP's comm hooks, FSDP2's gathers, the breakdown's probes), so saving, checkpoints and
resumes see the model they always see. They compile at their first call: the first step of the
first epoch, which `train.throughput_warmup_steps` leaves out of the steady-state samples/s
(docs/ddp.md has what it costs and buys). What is compiled is the network's forward (and so its
backward), not the mode's wrapper. Under DDP, Dynamo sees the network run inside DDP's forward and
compiles it with its DDPOptimizer, which splits the graph at DDP's gradient buckets, so their
all-reduces still overlap the backward. FSDP2's hooks stop Dynamo from compiling a module that
holds them: fsdp compiles each layer it gathers on its own, as torchtitan compiles each block.
Evaluation runs eager.
"""

from __future__ import annotations

import logging
import os
import shutil
import sysconfig
from contextlib import nullcontext
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from pipeline.errors import ConfigError


def toolchain_missing(device_type: str) -> str | None:
    """What TorchInductor lacks here to build its kernels, or None. On the CPU they are C++ built with
    $CXX, else g++ (torch._inductor.config.cpp.cxx); on GPUs Triton builds its launcher with $CC when
    it is set, else gcc or clang (triton.runtime.build). Both compile against Python's headers, found
    as they find them (a posix_local scheme read as posix_prefix)."""
    if device_type == "cuda":
        cc = os.environ.get("CC")
        if cc is not None and not (cc and shutil.which(cc)):
            return f"no C compiler at CC={cc!r}, which Triton builds its GPU launcher with"
        if cc is None and not (shutil.which("gcc") or shutil.which("clang")):
            return "no C compiler (CC, gcc or clang), which Triton builds its GPU launcher with"
    else:
        cxx = os.environ.get("CXX", "g++")
        if not shutil.which(cxx):
            return f"no C++ compiler {cxx!r} (CXX, else g++), which TorchInductor builds its CPU kernels with"
    scheme = sysconfig.get_default_scheme()
    headers = Path(sysconfig.get_paths("posix_prefix" if scheme == "posix_local" else scheme)["include"]) / "Python.h"
    if not headers.is_file():
        return f"no Python headers ({headers}), which the compiled kernels are built against"
    return None


def check_can_compile(device_type: str, mode: str, dp_devices: int = 1) -> None:
    """train.compile's refusals: a machine that cannot build the kernels, and DataParallel over more
    than one GPU, which re-makes its replicas from the module at every forward (a compiled module's
    replicas would all call the original's compiled forward, on its device)."""
    if mode == "dp" and dp_devices > 1:
        raise ConfigError(f"train.compile is true, but dp splits each batch over {dp_devices} GPUs with DataParallel, "
                          "which torch.compile cannot compile: train dp with train.compile false, or use ddp")
    missing = toolchain_missing(device_type)
    if missing:
        raise ConfigError(f"train.compile is true, but this machine has {missing}: install it (Debian and Ubuntu: "
                          "apt-get install g++ python3-dev), or set train.compile false")


# Graphs each compiled forward may need: its layer's shapes (one graph for every batch length of 2
# or more; 0 and 1, an empty or one-sample share and the sample DDP settles its buckets with, get
# their own), in training; evaluation runs eager.
GRAPHS_PER_FORWARD = 8


def compile_forwards(modules: Iterable[nn.Module], deterministic: bool = True) -> None:
    """Each module's forward compiled, in place (an attribute of the instance, so parameters, state_dict
    keys and hooks stay as they are): what runs around the forwards, DDP's reducer and FSDP2's
    gathers, stays eager. `deterministic` (train.deterministic): Inductor picks no kernel by timing
    it, so a resumed or re-made run on GPUs builds the kernels the first one ran.

    The forwards of torch's own layers, compiled so, share one code object (torch's wrapper of a
    bound method), and with it Dynamo's limit of graphs per code object: 8, which a model of a few
    layers under fsdp passes. Past it Dynamo runs the rest eager, and says so only in a warning;
    here the limits grow with the layers, and reaching them fails the training instead of training
    other than asked."""
    modules = list(modules)
    quiet_cpp_extension()
    dynamo, needed = torch._dynamo.config, GRAPHS_PER_FORWARD * len(modules)
    dynamo.recompile_limit = max(dynamo.recompile_limit, needed)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, needed)
    dynamo.fail_on_recompile_limit_hit = True
    if deterministic:
        from torch._inductor import config as inductor

        inductor.deterministic = True
    for module in modules:
        # dynamic: the batch's length a symbol, so a short last batch or DDP's uneven shares reuse
        # the first step's graph, not compile again in the middle of the measured steps.
        module.forward = torch.compile(module.forward, dynamic=True)


def uncompile(model: nn.Module) -> None:
    """`model` and its layers with their own forwards again: a trained model handed on (saved, copied,
    pickled) is not tied to the compiled code of this process."""
    for module in model.modules():
        if getattr(vars(module).get("forward"), "_torchdynamo_orig_callable", None) is not None:
            del module.forward


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def no_cuda_runtime_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("No CUDA runtime is found")


def quiet_cpp_extension() -> None:
    """Inductor asks torch.utils.cpp_extension where CUDA is, which on a host without a GPU warns on
    every rank that it found no CUDA runtime: true, and nothing compiled there needs one."""
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    if no_cuda_runtime_warning not in cpp_extension.filters:
        cpp_extension.addFilter(no_cuda_runtime_warning)


def eager(compiled: bool):
    """A context in which compiled forwards run eager (`compiled`: whether any is; without, nothing,
    not even Dynamo's import, a second a process): evaluation, which would otherwise compile its own
    graphs (no gradients, evaluation mode, its batch length), so that what is evaluated during
    training computes what `mnist-pipeline evaluate` computes from the saved model."""
    return torch.compiler.set_stance("force_eager") if compiled else nullcontext()
