"""SyncBatchNorm on the CPU, over gloo: torch's nn.SyncBatchNorm refuses CPU tensors in training
(its statistics kernels are CUDA's), so ddp on CPUs could not normalise by the global batch.

`GlooSyncBatchNorm` is a batch norm layer (the same parameters, buffers and state_dict keys; not an
nn.SyncBatchNorm, which DDP refuses on the CPU) whose training forward computes what torch's
SyncBatchNorm computes on GPUs: each channel's mean and
biased variance over every rank's share of the global batch, from sums all-reduced over the
process group (the sum with the sample count, then the sum of squared deviations from the global
mean: two passes, as a single device's batch norm takes; in float32 under any autocast), and the
running statistics updated with the unbiased variance. The sums' all-reduce is differentiable (`_SummedOverRanks`): its backward
all-reduces their gradients, so each rank's inputs get the gradient of the whole batch's loss, as
torch's SyncBatchNorm backward gives them. Every rank must run each
forward and backward (an empty share takes part with zero sums), as on GPUs. In evaluation, and
outside a process group, it is torch's batch norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


# torch.compile would break its graph at every layer's host sync (the sample count) and grow
# recompiles past pipeline.compiled's limits: untested, so refused (pipeline.parallel, pipeline.loop).
NOT_COMPILED = ("train.sync_batchnorm and train.compile are both true, but ddp trains on the CPU here, where its "
                "SyncBatchNorm (pipeline/gloo_batchnorm.py) is not compiled: set one of them false, or train on GPUs")


class _SummedOverRanks(torch.autograd.Function):
    """A tensor summed over the group's ranks; its gradient is too (every rank's loss depends on
    every rank's tensor). torch.distributed.nn's all_reduce does this, deprecated."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        summed = tensor.clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


def all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    return _SummedOverRanks.apply(tensor, group)


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    process_group = None  # the whole world's; torch's SyncBatchNorm keeps the one it was given

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized():
            return super().forward(input)
        self._check_input_dim(input)
        group = self.process_group or dist.group.WORLD
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        # Statistics in float32 whatever autocast gives (fp16's sums of squares overflow), as
        # torch's SyncBatchNorm takes them; the output in the input's type, as batch norm's.
        with torch.autocast(input.device.type, enabled=False):
            x = input.float()
            # The sample count rides with the first sums: one all-reduce (no gradient reaches it).
            count = torch.full((1,), float(x.numel() // max(x.size(1), 1)))
            summed = all_reduce(torch.cat([x.sum(dims), count]), group)
            n = summed[-1].item()
            if n <= 1:
                raise ValueError(f"Expected more than 1 value per channel when training, got {n:.0f} over the ranks")
            mean = summed[:-1] / n
            centred = x - mean.view(shape)
            var = all_reduce((centred * centred).sum(dims), group) / n
            out = centred * torch.rsqrt(var + self.eps).view(shape)
            if self.weight is not None:
                out = out * self.weight.view(shape)
            if self.bias is not None:
                out = out + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                # None: a cumulative average, as _BatchNorm.forward takes it.
                factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(var.detach() * (n / (n - 1)), alpha=factor)
        return out.to(input.dtype)


def convert(model: nn.Module, device: torch.device) -> nn.Module:
    """`model`'s BatchNorm layers as SyncBatchNorm, with the same parameters and buffers (torch's
    convert_sync_batchnorm): torch's on GPUs; on the CPU each becomes a GlooSyncBatchNorm (the
    class swapped on the layer torch's conversion made: its attributes are a batch norm's)."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if device.type == "cpu":
        for module in model.modules():
            if type(module) is nn.SyncBatchNorm:
                module.__class__ = GlooSyncBatchNorm
    return model
