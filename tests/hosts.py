"""Two hosts on one machine, for the multi-node tests: two network namespaces joined by a veth pair,
each end named eth1 and addressed inside 10.231.7.0/24, and each command run there with its own
hostname and an /etc/hosts that names both hosts (../shared/reference/sandbox-cluster.md has the
facts this rests on). Test traffic goes only to these addresses and to loopback.

Needs root and iproute2/util-linux (nsenter, unshare); `skip_reason()` says when that is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.231.7"
INTERFACE = "eth1"  # the same name on every host, as on a real cluster, so one GLOO_SOCKET_IFNAME fits all
# Inside a host: its own hostname and /etc/hosts (a private mount), then the command.
ENTER = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "emulating hosts needs root (network namespaces, veth, mounts)"
    missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)} (iproute2, util-linux)" if missing else None


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    netns: str
    hosts_file: Path

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` as run on this host."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--uts", "--mount", "--propagation",
                "private", "sh", "-c", ENTER, self.name, str(self.hosts_file), *argv]

    def popen(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            return subprocess.Popen(self.argv(argv), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


class TwoHosts:
    """`node-a` (10.231.7.1) and `node-b` (10.231.7.2); torn down on exit, whatever happened."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.netns = (f"mnp{tag}a", f"mnp{tag}b")
        self.dir = Path(tempfile.mkdtemp(prefix="mnp-hosts-"))
        hosts = self.dir / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n{SUBNET}.1 node-a\n{SUBNET}.2 node-b\n")
        self.hosts = [Host("node-a", f"{SUBNET}.1", self.netns[0], hosts),
                      Host("node-b", f"{SUBNET}.2", self.netns[1], hosts)]

    def __enter__(self) -> list[Host]:
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self.hosts

    def _create(self) -> None:
        ends = [f"{ns}0" for ns in self.netns]
        for ns in self.netns:
            _ip("netns", "add", ns)
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for host, end in zip(self.hosts, ends):
            _ip("link", "set", end, "netns", host.netns)
            _ip("-n", host.netns, "link", "set", end, "name", INTERFACE)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
            _ip("-n", host.netns, "link", "set", INTERFACE, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")

    def __exit__(self, *exc) -> None:
        for ns in self.netns:
            # Whatever still runs there (a server, a stray worker) goes with its namespace.
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def wait_until(check, what: str, timeout: float = 120, interval: float = 0.5, diagnose=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{diagnose()}")
        time.sleep(interval)
