"""The networks. `small` has no dropout or batch norm, so every mode computes the same function
of the same batches and the modes' weights can be compared exactly; `classic` is the familiar
PyTorch-examples CNN, with dropout."""

from __future__ import annotations

from torch import nn


def small_cnn() -> nn.Module:
    # Two narrow conv blocks cost about what one wide conv layer does on a CPU, and clear 99% test
    # accuracy in 2 epochs with a margin a single conv layer lacks (tests/test_full_mnist.py).
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 28 -> 14
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 14 -> 7
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def classic_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=3),
        nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(64 * 12 * 12, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, 10),
    )


# MNIST's `model` argument (pipeline.workloads.mnist, workload.init_args.model) names one of these.
MODELS = {"small": small_cnn, "classic": classic_cnn}


def build_model(name: str) -> nn.Module:
    return MODELS[name]()
