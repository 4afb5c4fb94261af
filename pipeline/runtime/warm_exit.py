"""How a `mnist-pipeline` process ends: a command run here or in a fork of the warm server ends
without the interpreter's slow teardown (`run_and_exit`), and a stage's client ends as the fork it
stood in for did (`exit_like`).

Imports only the standard library: every stage's client ends through it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable, NoReturn


def run_and_exit(command: Callable[[], object]) -> NoReturn:
    """Run `command`, then end this process as the interpreter would, but without tearing it down:
    with torch, MLflow and matplotlib loaded, freeing every module's objects one by one took
    seconds after the last output, on every stage. What an ending must do is done: other threads are
    joined, the exit handlers run (MLflow ends its runs, logging flushes and closes its files),
    Python's and C's buffered output is flushed, and an uncaught exception is shown as Python shows
    it. Every file the pipeline writes is closed by then (pipeline.atomic)."""
    code, sig = 0, None
    try:
        command()
    except SystemExit as done:
        code = exit_code(done.code)
    except KeyboardInterrupt:  # Python shows it, and ends by the signal
        traceback.print_exc()
        code, sig = 130, signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what the interpreter's own ending does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    flush_c_streams()
    if sig is not None:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(code & 0xFF)


def flush_c_streams() -> None:
    """What C's exit() would flush: libraries' own printf output (cuDNN's and NCCL's logs) to a pipe."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def exit_code(code: object) -> int:
    """The exit status SystemExit(code) gives, as the interpreter reads it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_like(code: int) -> None:
    """Exit as the fork did: its code, or killed by its signal (what a shell and DVC report)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        code = 128 - code
    sys.exit(code)
