"""Where the warm server's socket is: a file in a folder only this user can enter, named through
a secret kept there (`server_address`), and how long a client waits to connect to it.

Imports only the standard library: every stage's client looks its server up.
"""

from __future__ import annotations

import hashlib
import os
import stat

from pipeline.runtime.warm_common import Unavailable

# A server accepts at once, even while it imports; a name whose queue is full (another user's
# process took it after our server's idle exit, and accepts nothing) would block connect() forever.
# With a timeout, the kernel answers a full queue of a Unix socket at once (EAGAIN).
CONNECT_TIMEOUT_S = 5


def server_address(key: str) -> str:
    """The server's socket: a file in a folder only this user can enter (so no other user can
    connect to it, take its name or fill its queue), named by the key through a secret kept there:
    /proc/net/unix shows every socket's path to every user, and the key digests the environment."""
    folder = private_folder()
    digest = hashlib.sha256(secret(folder) + key.encode()).hexdigest()[:32]
    return os.path.join(folder, f"warm-{digest}.sock")


def private_folder() -> str:
    """$XDG_RUNTIME_DIR/mnist-pipeline (systemd's per-user folder), else /tmp/mnist-pipeline-UID:
    made here when missing; Unavailable unless it is a folder of this user that no one else may
    enter or write (another user may have made it first, to catch or stall our commands)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    folder = os.path.join(runtime, "mnist-pipeline")
    if not os.path.isabs(runtime) or len(os.fsencode(folder)) > MAX_FOLDER_BYTES:
        folder = f"/tmp/mnist-pipeline-{os.getuid()}"
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise Unavailable(f"no private folder for the warm server's socket: {folder}: {exc.strerror}") from None
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise Unavailable(f"{folder} is not this user's private folder (owner uid {info.st_uid}, mode "
                          f"{stat.filemode(info.st_mode)}): remove it, and the next command makes it again")
    return folder


# A socket's path has at most 107 bytes (sun_path); the name in the folder takes 43 of them.
MAX_FOLDER_BYTES = 107 - len("/warm-.sock") - 32


def secret(folder: str) -> bytes:
    """32 random bytes kept in `folder` (made by whichever command needs them first)."""
    path = os.path.join(folder, "secret")
    try:
        with open(path, "rb") as kept:
            return kept.read()
    except FileNotFoundError:
        pass
    draft = f"{path}.{os.getpid()}"
    with open(os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as made:
        made.write(os.urandom(32))
    try:
        os.link(draft, path)  # all of it or nothing, and the first one made stays
    except FileExistsError:
        pass
    finally:
        os.unlink(draft)
    with open(path, "rb") as kept:
        return kept.read()
