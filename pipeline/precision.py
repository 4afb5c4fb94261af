"""Mixed precision: which dtype autocast uses, and a forward that enters it itself.

Autocast state is thread-local. DataParallel runs each replica's forward in a thread of its own and
re-enters autocast there with only `enabled=` (torch.nn.parallel.parallel_apply), so the replica
computes in that thread's default dtype, float16 on CUDA, not the bfloat16 the loop asked for: the
replicas would then train in fp16 without a grad scaler. PyTorch's AMP notes give the fix used here:
enter autocast, with its dtype, inside the model's forward, which runs in every replica's thread.
"""

from __future__ import annotations

import torch
from torch import nn


def autocast_dtype(device: torch.device, bf16: bool, fp16: bool = False) -> torch.dtype | None:
    """float16 wherever it is asked for (`train.fp16`, with a gradient scaler: grad_scaler); else
    bfloat16 on a GPU that computes it natively (Ampere or newer) when asked; else full float32.
    An emulated bf16 (older GPUs) is slower than float32, so it is never chosen."""
    if fp16:
        return torch.float16
    if device.type == "cuda" and bf16 and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return None


class AutocastForward(nn.Module):
    """`module`, whose forward always runs under autocast(device_type, dtype), in whatever thread
    calls it. It holds no weights of its own: `module` is the one to save and load."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.module = module
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def grad_scaler(device: torch.device, fp16: bool) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (None without `train.fp16`). float16 ends at 65504 and loses gradients
    below about 6e-8 to zero, so the loss is multiplied up before the backward and the gradients
    divided back before clipping and the step; a step whose gradients overflowed is skipped and the
    scale halved, and after 2000 clean steps it doubles (torch.amp.GradScaler's defaults). bf16 has
    float32's range and needs none. The scale is state: checkpoints carry it, so a resume goes on
    with the scale the uninterrupted training had."""
    return torch.amp.GradScaler(device.type) if fp16 else None


def float32_means_float32() -> None:
    """With `train.bf16: false` the user asked for float32: keep cuDNN's convolutions off TF32 (its
    10-bit mantissa, cuDNN's default on Ampere and newer), as matmuls already are by default.
    Then the modes agree to float32 rounding, which the GPU equivalence checks rely on. (torch
    2.9's per-backend API; mixing it with the legacy allow_tf32 flags is an error.)"""
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cuda.matmul.fp32_precision = "ieee"


def with_autocast(module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    return module if dtype is None else AutocastForward(module, device.type, dtype)
