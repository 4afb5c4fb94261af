"""The tracking calls of the stages after training (evaluate, compare), made by a helper process
that imports MLflow while the stage itself imports torch and matplotlib and computes.

MLflow with its SQL store costs more than a bare torch import to load (benchmarks/
pipeline_overhead.py). In the stage's own process that import came before or between the stage's
work; in a helper started first thing (stages/cli.py), it runs on another core beside it. The stage
then sends each call (`CALLS`, pipeline.tracking.after_training's own functions, run unchanged in the helper) as
one JSON line and waits for its answer: an error comes back as the same one-line PipelineError the
call would have raised in the stage. Should the helper be gone before it took a call, the call runs
in the stage itself; gone during one, the stage fails: nothing is ever logged twice.

Imports nothing heavy: the CLI starts the helper before it loads the stage's module.
"""

from __future__ import annotations

import atexit
import json
import logging
import subprocess
import sys
from typing import Any

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)
CALLS = ("log_to_mode_run", "log_compare_run")
_running: Helper | None = None


# How long a stage that ends (Ctrl-C, an error) waits for the helper to finish a call it took: a
# compare run it is making must still end FINISHED or FAILED, not be cut off RUNNING. MLflow's own
# retries are kept short (pipeline/tracking/__init__.py), so a call does not take longer.
IN_FLIGHT_S = 60


class Helper:
    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "pipeline.tracking.helper_main"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        self._in_flight = False  # a call taken, its answer not read yet

    def call(self, name: str, **kwargs: Any) -> Any:
        """`pipeline.tracking.after_training.<name>(**kwargs)`, run in the helper; NOT_SENT if the helper is gone
        before it took the call (then the caller makes it: nothing is logged twice)."""
        try:
            self._proc.stdin.write(json.dumps({"call": name, "kwargs": kwargs}) + "\n")
            self._proc.stdin.flush()
            taken = self._proc.stdout.readline()
        except OSError:
            taken = ""
        if not taken:
            log.warning("the tracking helper process ended (exit code %s); logging from this process",
                        self._proc.poll())
            return NOT_SENT
        self._in_flight = True
        answer = self._proc.stdout.readline()
        self._in_flight = False
        if not answer:  # it died during the call: part of it may be in the store already
            raise PipelineError(f"tracking: the helper process logging {name} ended (exit code {self._proc.wait()}) "
                                "before it finished; run this stage again")
        reply = json.loads(answer)
        if "error" in reply:
            raise PipelineError(reply["error"])
        if "bug" in reply:
            raise RuntimeError(f"tracking helper, in {name}:\n{reply['bug']}")
        return reply["result"]

    def close(self) -> None:
        """The helper has nothing left to do once the call it may be making ends."""
        try:
            self._proc.stdin.close()
        except OSError:  # gone already
            pass
        try:
            self._proc.wait(timeout=IN_FLIGHT_S if self._in_flight else 2)
        except subprocess.TimeoutExpired:  # still warming up (a slow store), or a call hung
            self._proc.kill()
            self._proc.wait()


NOT_SENT = object()  # the helper is not running: the caller makes the call itself


def start() -> None:
    """Start the helper for this process's tracking calls (stages/cli.py, before the stage loads)."""
    global _running
    if _running is None:
        _running = Helper()
        atexit.register(_stop)


def call(name: str, **kwargs: Any) -> Any:
    """Run the tracking call in the helper if one runs; `NOT_SENT` if not, and the caller runs it."""
    if _running is None:
        return NOT_SENT
    result = _running.call(name, **kwargs)
    if result is NOT_SENT:
        _stop()
    return result


def _stop() -> None:
    global _running
    if _running is not None:
        _running.close()
        _running = None
