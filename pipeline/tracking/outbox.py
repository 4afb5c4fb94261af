"""A rank's tracking calls, written to disk first and sent by a background thread: training never
waits on the tracking server, and what could not be sent outlives the process.

Each call is one JSON line in `<folder>/<name>.jsonl`; `<name>.sent` holds how many lines were
delivered, in order, and `<name>.target` the store they were made for (for messages only: where they go is the user's
current setting). The thread retries a failed delivery (the server is down) until it goes
through; `drain` waits a bounded time for the rest, and `replay` sends what a finished process left
behind (the `send-runs` command). Delivery must be idempotent: after a crash between a delivery and
its `.sent` update, that line is delivered again.

A failure is one of two kinds, and `refused` (given by the caller, who knows the client) tells
them apart: a server that is away (no connection, a 5xx) is waited for; one that says no (a 4xx,
no permission, a read-only or full store) would say no forever, so sending stops at once and the
reason is kept in `refusal`. The file is not trusted as code is: `check` vets every line before it
is sent (what it may upload, which run it names), and a line that fails it, or is not JSON, is
reported as `file:line` and skipped while the good lines go on.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from pipeline.atomic import write_text
from pipeline.errors import ConfigError, PipelineError

log = logging.getLogger(__name__)
RETRY_S = (1, 2, 4, 8)  # waits between attempts while the server is away, then every 8 s


def _never(exc: Exception) -> bool:
    return False


class Outbox:
    def __init__(self, folder: Path, name: str, deliver: Callable[[dict], Any], target: str,
                 refused: Callable[[Exception], bool] = _never, check: Callable[[dict], None] | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        self.path, self._sent_path = folder / f"{name}.jsonl", folder / f"{name}.sent"
        write_text(folder / f"{name}.target", target + "\n")
        self._deliver, self._refused = deliver, refused
        # What an earlier attempt (a torchrun restart) could not send goes first.
        self._ops, self._sent = read(self.path, self._sent_path, check)
        self.last_error: Exception | None = None
        self.refusal: Exception | None = None  # once set, nothing more is sent
        self.disk_error: Exception | None = None  # once set, calls are kept in memory only
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._send_forever, name=f"outbox-{name}", daemon=True)
        self._thread.start()

    def put(self, op: dict) -> None:
        """Keep `op` on disk, then hand it to the sender; returns at once."""
        line = json.dumps(op, separators=(",", ":"))
        with self._cond:
            if self.disk_error is None:
                try:
                    with self.path.open("a") as handle:
                        handle.write(line + "\n")
                except OSError as exc:  # a full disk must not stop training: keep it in memory
                    self.disk_error = exc
                    log.warning("%s: cannot keep tracking calls on disk (%s); they wait in memory to be sent",
                                self.path, exc)
            self._ops.append(op)
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._ops) - self._sent

    def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for everything put so far to be delivered; what is left."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._sent < len(self._ops) and self.refusal is None
                   and (left := deadline - time.monotonic()) > 0):
                self._cond.wait(left)
            return len(self._ops) - self._sent

    def close(self) -> None:
        """Stop sending; with nothing left, remove the files (a clean run leaves no outbox)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            if self._sent == len(self._ops):
                _remove(self.path)

    def _send_forever(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while self._sent == len(self._ops) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                op = self._ops[self._sent]
            try:
                if op is not None:  # None: a damaged line, reported when read
                    self._deliver(op)
            except Exception as exc:
                self.last_error = exc
                if self._refused(exc):  # asking again would get the same answer
                    log.error("%s (%s); nothing more is sent, what is left is kept in %s",
                              "a call cannot be made" if isinstance(exc, ConfigError)  # the model's, not the store's
                              else "the tracking server refused a call", _short(exc), self.path)
                    with self._cond:
                        self.refusal = exc
                        self._cond.notify_all()
                    return
                # The server is away: keep the op, try again later.
                if failures == 0:
                    log.warning("tracking server unreachable (%s); training goes on, tracking is kept in %s "
                                "and sent when it answers", _short(exc), self.path.parent)
                time.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
                failures += 1
                continue
            if failures:
                log.warning("tracking server answers again; sending what was kept")
            failures = 0
            with self._cond:
                self._sent += 1
                if self.disk_error is None:
                    try:
                        write_text(self._sent_path, f"{self._sent}\n")
                    except (OSError, PipelineError) as exc:  # the file on disk goes stale: stop writing it
                        self.disk_error = exc
                self._cond.notify_all()


class DeliveryFailed(Exception):
    """A kept call that could not be sent: where it is (file:line) and why (`cause`)."""

    def __init__(self, where: str, cause: Exception):
        super().__init__(f"{where}: {cause}")
        self.where, self.cause = where, cause


def read(path: Path, sent_path: Path, check: Callable[[dict], None] | None = None) -> tuple[list[dict | None], int]:
    """The calls kept in `path`, one per line (None for a line that is damaged or fails `check`,
    each reported as file:line), and how many of them were sent already."""
    try:
        sent = int(sent_path.read_text()) if sent_path.is_file() else 0
    except (ValueError, UnicodeDecodeError):
        log.warning("%s: damaged; sending every call in %s again (each is sent once)", sent_path, path.name)
        sent = 0
    ops: list[dict | None] = []
    for number, raw in enumerate(path.read_bytes().splitlines() if path.is_file() else [], start=1):
        try:
            op = json.loads(raw.decode())
            if not isinstance(op, dict):
                raise ValueError("not a JSON object")
            if check is not None:
                check(op)
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # json's and the decoder's too
            if number > sent:
                log.warning("%s:%d: skipped, not a tracking call this training made (%s)", path, number, _short(exc))
            op = None
        ops.append(op)
    return ops, sent


def replay(path: Path, deliver: Callable[[dict], Any], check: Callable[[dict], None] | None = None) -> int:
    """Send, in order, what a process left undelivered in `path`; how many were sent. Stops at the
    first failure (raised), having recorded what went through; removes the files once all did."""
    sent_path = path.with_suffix(".sent")
    ops, sent = read(path, sent_path, check)
    skipped = [line for op, line in zip(ops[sent:], path.read_bytes().splitlines()[sent:]) if op is None]
    if skipped:  # kept, not lost: reported line by line when read, and left for a look
        with path.with_suffix(".rejected").open("ab") as rejected:
            rejected.write(b"".join(line + b"\n" for line in skipped))
    delivered = 0
    for index in range(sent, len(ops)):
        if ops[index] is not None:
            try:
                deliver(ops[index])
            except Exception as exc:
                raise DeliveryFailed(f"{path}:{index + 1}", exc) from exc
            delivered += 1
        write_text(sent_path, f"{index + 1}\n")
    _remove(path)
    return delivered


def discard(folder: Path, name: str = "*") -> int:
    """Remove an outbox (every rank's, or rank `name`'s), without reading its calls as such:
    however damaged, it goes. Returns how many lines it held unsent."""
    if folder.is_symlink():  # never what it points to
        folder.unlink()
        return 0
    left = unsent(folder, name)
    for path in folder.glob(f"{name}.jsonl") if folder.is_dir() else []:
        _remove(path)
    if name == "*" and folder.is_dir():
        shutil.rmtree(folder)
    return left


def unsent(folder: Path, name: str = "*") -> int:
    """How many lines an outbox (every rank's, or rank `name`'s) holds unsent, read as lines only."""
    left = 0
    for path in folder.glob(f"{name}.jsonl") if folder.is_dir() and not folder.is_symlink() else []:
        try:
            sent = int(path.with_suffix(".sent").read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            sent = 0
        left += max(path.read_bytes().count(b"\n") - sent, 0)
    return left


def _remove(path: Path) -> None:
    """A fully sent outbox: its files, and the folder once no other rank's remain."""
    for suffix in (".jsonl", ".sent", ".target"):
        path.with_suffix(suffix).unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:  # another rank's outbox is still there
        pass


def _short(exc: Exception) -> str:
    """The error's own words, first line: SQLAlchemy's wrapper (`orig`) gives the database's
    ("database is locked"), not its note on what raised it ("(raised as a result of Query-invoked
    autoflush ...)")."""
    exc = getattr(exc, "orig", None) or exc
    lines = [line for line in str(exc).splitlines() if line.strip() and not line.lstrip().startswith(("(raised as", "[SQL: (raised as"))]
    return (lines[0] if lines else type(exc).__name__)[:200]
