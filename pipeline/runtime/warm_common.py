"""What a stage's client of the warm server (pipeline/runtime/warm.py) and the server share: the
settings read from the environment, the errors that make a command run in its own process instead,
and how a "module:function" name is found.

Imports only the standard library: every stage's client imports it.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

WARM_ENV = "MNIST_PIPELINE_WARM"  # 0: never; 1: for every command; unset: under DVC only
IDLE_ENV = "MNIST_PIPELINE_WARM_IDLE_S"  # how long a server with nothing to run stays (default 30)


class Unavailable(Exception):
    """No server to be had; the command runs in this process."""


class TimedOut(Unavailable):
    """No answer within the time asked for."""


class Refused(Unavailable):
    """The server said it cannot run commands (an import failed, or made it unfit to fork)."""


def debugging() -> bool:
    return os.environ.get("MNIST_PIPELINE_DEBUG", "") not in ("", "0")


def named(target: str) -> Callable:
    """The function "module:function" names."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)
