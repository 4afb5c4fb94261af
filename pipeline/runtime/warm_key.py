"""The warm server's key (`server_key`): a digest of everything a fresh `mnist-pipeline` process
reads before its command starts, so that a fork runs the command only where it would run as in a
fresh process (pipeline/runtime/warm.py lists what it covers), and which environment variables are
the stage's own, passed to each fork instead (`per_command`).

Imports only the standard library: every stage's client computes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import resource
import sys
from pathlib import Path
from typing import Iterable

from pipeline.runtime.warm_common import Unavailable

PROTOCOL = 1
# Named by the stage, not by what a fresh process reads: no part of the server's key.
PER_COMMAND_ENV = ("PWD", "OLDPWD", "SHLVL", "_")
PER_COMMAND_PREFIX = "DVC_"


def unbuffered() -> bool:
    """Whether this Python runs with -u (or PYTHONUNBUFFERED), which sys.flags does not say: its
    standard streams then write through to unbuffered files."""
    stream = sys.__stdout__ or sys.__stderr__
    return type(getattr(stream, "buffer", None)).__name__ == "FileIO"


def per_command(name: str) -> bool:
    return name in PER_COMMAND_ENV or name.startswith(PER_COMMAND_PREFIX)


def server_key(packages: Iterable[str]) -> str:
    """A digest of everything a fresh `mnist-pipeline` process would read before its command
    starts, and so everything a fork of the server must share with this process."""
    facts = {
        "protocol": PROTOCOL,
        "python": [sys.executable, sys.version, repr(sys.flags), unbuffered(), sys.warnoptions, sys._xoptions,
                   [os.path.abspath(p) for p in sys.path]],
        "cwd": os.getcwd(),  # read on import (a matplotlibrc here, multiprocessing's ORIGINAL_DIR)
        "code": code_digest(packages),
        "packages": installed(),
        "outside": outside_code(packages),
        "config": [config_stamp(path) for path in matplotlib_configs()],  # read when matplotlib loads
        "env": sorted((k, v) for k, v in os.environ.items() if not per_command(k)),
        "user": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
        "host": [os.uname().nodename, namespaces(), read("/proc/self/cgroup")],
        "cpus": sorted(os.sched_getaffinity(0)),
        "priority": os.getpriority(os.PRIO_PROCESS, 0),
        "limits": [resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:40]


def code_digest(packages: Iterable[str]) -> str:
    """The project's own code (`packages`) as it is on disk: an edit starts a new server."""
    digest = hashlib.sha256()
    for folder in package_folders(packages):
        for path in sorted(Path(folder).rglob("*.py")):
            if path.is_file():  # not an editor's lock file (.#model.py, a link to nowhere)
                digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def package_folders(packages: Iterable[str]) -> list[str]:
    """The folders of the project's `packages`, as an import finds them."""
    found = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        found.extend((spec.submodule_search_locations or []) if spec else [])
    return found


def project_folders(packages: Iterable[str]) -> list[str]:
    return [os.path.dirname(os.path.abspath(folder)) for folder in package_folders(packages)]


def installed() -> list[str]:
    """The installed distributions, with their versions, and the .pth files with what they say
    (pip install, uninstall, an editable install)."""
    found = []
    for folder in sys.path:
        if folder.endswith(("site-packages", "dist-packages")) and os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith((".dist-info", ".egg-info")):  # a reinstall of one version rewrites its RECORD
                    found.append(name + "\0" + repr(config_stamp(os.path.join(folder, name, "RECORD"))[1:]))
                elif name.endswith(".pth"):
                    found.append(name + "\0" + read(os.path.join(folder, name)))
    return found


def outside_code(packages: Iterable[str]) -> list:
    """Every module file a fresh process could import from outside the standard library, the
    installed distributions and the project's own packages (code_digest): what `PYTHONPATH` or a
    .pth file adds. Stamped by size and modification time, as Python's own caches check them."""
    stamps = []
    skip = {os.path.abspath(p) for p in (os.getcwd(), *stdlib_folders(), *project_folders(packages))}
    for entry in sys.path:
        folder = os.path.abspath(entry or ".")
        if folder in skip or folder.endswith(("site-packages", "dist-packages")) or not os.path.isdir(folder):
            continue
        skip.add(folder)
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d.isidentifier())  # a package's name is one
            stamps.extend([os.path.join(root, name), *config_stamp(os.path.join(root, name))[1:]]
                          for name in sorted(files) if name.endswith((".py", ".so", ".pth")))
            if len(stamps) > MAX_OUTSIDE_FILES:
                raise Unavailable(f"{folder} (on sys.path) holds over {MAX_OUTSIDE_FILES} module files to key")
    return stamps


MAX_OUTSIDE_FILES = 20000


def stdlib_folders() -> list[str]:
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    return [os.path.join(prefix, "lib", version, sub) for prefix in {sys.base_prefix, sys.base_exec_prefix}
            for sub in ("", "lib-dynload")]


def matplotlib_configs() -> list[str]:
    """Where matplotlib looks for a matplotlibrc when it is imported."""
    config_dir = os.environ.get("MPLCONFIGDIR") or os.path.join(
        os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "matplotlib")
    return [os.path.join(os.getcwd(), "matplotlibrc"), os.environ.get("MATPLOTLIBRC", ""),
            os.path.join(config_dir, "matplotlibrc")]


def config_stamp(path: str) -> list:
    try:
        stat = os.stat(path)
    except OSError:
        return [path, None]
    return [path, stat.st_mtime_ns, stat.st_size]


def namespaces() -> list[str]:
    found = []
    for kind in ("mnt", "net", "uts", "ipc", "pid", "user", "cgroup"):
        try:
            found.append(os.readlink(f"/proc/self/ns/{kind}"))
        except OSError:
            found.append(kind)
    return found


def read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
