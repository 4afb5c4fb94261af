"""The optimizer and the learning-rate schedule that params.yaml names (`train.optimizer`,
`train.schedule`), built alike in every mode and on every rank.

The defaults, Adam under a one-cycle schedule, make the same calls the loop made before they were
settings, so MNIST's weights are what they were, bit for bit. Every schedule steps once per
optimizer step and spans the whole training (`steps`), so a resumed training, which loads the
schedule's state, goes on where it stopped."""

from __future__ import annotations

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LRScheduler, OneCycleLR

from pipeline.config import TrainConfig


def build_optimizer(params, config: TrainConfig) -> Optimizer:
    """`config.optimizer` over `params`, starting at `config.lr` (a one-cycle schedule then sets
    its own first rate)."""
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "adamw":  # weight decay apart from the gradient's moments (decoupled)
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    raise ValueError(f"train.optimizer = {config.optimizer!r}: no such optimizer")  # config.py refuses it first


def build_schedule(optimizer: Optimizer, config: TrainConfig, steps: int) -> LRScheduler:
    """`config.schedule` over `steps` optimizer steps:
    - onecycle: from lr/25 up to lr over the first 30% of the steps, then down to lr/25e4 (torch's
      OneCycleLR). Adam's and AdamW's beta1 cycles against it (0.95 to 0.85 and back), as torch's
      default does; SGD keeps `train.momentum` throughout.
    - cosine: from lr down to 0 along half a cosine.
    - constant: lr throughout."""
    if config.schedule == "onecycle":
        return OneCycleLR(optimizer, max_lr=config.lr, total_steps=steps,
                          cycle_momentum=config.optimizer != "sgd")
    if config.schedule == "cosine":
        return CosineAnnealingLR(optimizer, T_max=steps)
    if config.schedule == "constant":
        return ConstantLR(optimizer, factor=1.0, total_iters=0)
    raise ValueError(f"train.schedule = {config.schedule!r}: no such schedule")  # config.py refuses it first
