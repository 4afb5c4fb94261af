"""One training of a mode at a time in a project: a lock in the mode's output folder.

Two trainings of one mode would write the same checkpoint, the same unfinished.json and, on a new
SQLite store, race in its table creation. The second is refused at once, naming the first. The
lock is an flock on a file that stays (removing it would let a third process lock a new file while
the second still holds the old one); the kernel drops it when its holder dies, however it dies.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline.errors import PipelineError

LOCK_FILE = ".train.lock"  # in .dvcignore: not part of the mode's outputs


@contextmanager
def held(folder: Path, what: str) -> Iterator[None]:
    """Hold `folder`'s lock for the block; a PipelineError naming the holder if another has it."""
    path = folder / LOCK_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise PipelineError(f"{path}: cannot be made ({exc.strerror}); run from a folder you can write to, or fix "
                            "its permissions") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = path.read_text().strip() or "another process"
            raise PipelineError(
                f"{folder}: another training of this mode is running in this project ({holder}); wait for it "
                "to end or stop it, then run again") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{what}, pid {os.getpid()} on {socket.gethostname()}, "
                     f"since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock
