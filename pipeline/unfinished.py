"""The record that tells an interrupted training from a finished one, `models/<mode>/unfinished.json`:
read by `train` and by `send-runs`, which loads no torch, so it has a module of its own."""

from __future__ import annotations

import json
from pathlib import Path

# Written when the `train` command starts a training, removed once it ends well (or, after an end
# that failed, once send-runs has sent what it kept): if it is there, that training was interrupted
# (a failure, a kill, a lost machine). OUTPUTS_COMPLETE in it: rank 0 had written every output, and
# logged the model to the run it names ("" untracked).
UNFINISHED_FILE = "unfinished.json"
OUTPUTS_COMPLETE = "outputs_complete"


def unfinished(out_dir: Path) -> dict | None:
    """The record of an interrupted training in `out_dir`, or None if the last one finished."""
    path = out_dir / UNFINISHED_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return {}  # unreadable: an interrupted training of unknown inputs, so never continued
