"""How a process ends: a stop signal unwinds it like an error, so every `finally` and every "mark
the run FAILED" runs; and the cleanup after it is not cut short by the next signal.

SIGTERM (torchrun stopping a worker, a scheduler's pre-emption, `docker stop` without an init)
raises SystemExit(143). SIGINT (Ctrl-C, or `docker stop` through the image's dumb-init) keeps
Python's KeyboardInterrupt. Once one of them arrived, or `shield()` is called, both are ignored
until the block ends, then the handlers the process had before come back.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _stop(signum, frame) -> None:
    """The first stop signal unwinds; the ones after it are ignored until the block ends. A
    job-wide SIGTERM (scancel, systemctl stop) or a Ctrl-C reaches a warm server's fork twice, from
    the kill itself and forwarded by its client: the second must not cut short the `finally`
    blocks the first one set going (stopping the workers, ending the runs)."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is _stop:
            signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@contextmanager
def stop_signals_unwind() -> Iterator[Callable[[], None]]:
    """Yields `shield`: call it before cleanup that must finish. Signal handlers belong to the main
    thread, so in any other thread (a launcher that runs training in a thread) this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def shield() -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    signal.signal(signal.SIGTERM, _stop)
    if previous[signal.SIGINT] is signal.default_int_handler:  # not where Ctrl-C is ignored (nohup, `&`)
        signal.signal(signal.SIGINT, _stop)
    try:
        yield shield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
