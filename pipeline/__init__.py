"""Data-parallel MNIST training: the library behind the `mnist-pipeline` stages."""

__version__ = "0.1.0"
