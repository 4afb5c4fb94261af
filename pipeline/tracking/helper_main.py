"""The tracking helper process itself (`python -m pipeline.tracking.helper_main`, started by
pipeline.tracking.helper): MLflow and the store loaded first, then pipeline.tracking.after_training's
calls, one per line. A module of its own, imported by nothing: after_training imports the helper's
client side, and this side imports after_training, so neither import runs back up.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.tracking.helper import CALLS


def serve() -> None:
    """The helper: MLflow and the store loaded first, then one call per line on stdin, answered
    on the stdout it was given (MLflow's own printing goes to stderr): an empty line when it takes
the call, then the call's answer."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the stage's to handle; this ends with it
    from pipeline.config import TrackingConfig

    from pipeline.tracking import after_training, store

    try:  # what the first call would otherwise wait for: MLflow, and a local store's schema check
        from mlflow import MlflowClient

        client = MlflowClient(store.tracking_uri())
        if store.tracking_uri().startswith("sqlite:"):  # a server is only asked when a call needs it
            client.search_experiments(max_results=1)
    except Exception:  # the call itself reports what is wrong with the store
        pass
    for line in sys.stdin:
        request = json.loads(line)
        answers.write("{}\n")  # taken: from here on the call is this process's to make
        answers.flush()
        kwargs = request["kwargs"]
        kwargs["config"] = TrackingConfig(**kwargs["config"])
        kwargs["artifacts"] = [Path(path) for path in kwargs["artifacts"]]
        if kwargs.get("datasets"):
            kwargs["datasets"] = (Path(kwargs["datasets"][0]), tuple(kwargs["datasets"][1]))
        try:
            if request["call"] not in CALLS:  # only the calls this module exists for, never any attribute
                raise ValueError(f"not a tracking helper call: {request['call']!r}")
            reply = {"result": getattr(after_training, request["call"])(**kwargs)}
        except PipelineError as exc:
            reply = {"error": str(exc)}
        except Exception:
            reply = {"bug": traceback.format_exc()}
        answers.write(json.dumps(reply) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
