"""Check a c10d rendezvous endpoint before torchrun uses it, so a launcher fails in seconds with a
reason instead of hanging.

torchrun's agent makes its TCPStore at the rendezvous endpoint: the first node hosts it, the others
connect. When another program already holds the port, the host's bind fails, and a client that
reaches that program waits inside TCPStore's handshake with no timeout that applies and no Ctrl-C
(seen: minutes). Here the host checks that it can bind the port, and a client first waits for the
port to accept (the host may start later) and then for a real store's answer, each bounded.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

from pipeline.errors import PipelineError

ANSWER_S = 10  # a TCPStore answers a client at once: far less than this


def parse_endpoint(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    try:
        return host.strip("[]"), int(port or default_port)
    except ValueError:
        raise PipelineError(f"rendezvous endpoint {endpoint!r}: the port must be a number (HOST:PORT)") from None


def check_host_port(host: str, port: int) -> None:
    """On the node that hosts the rendezvous: its port must be free to bind."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds: TIME_WAIT is no conflict
        try:
            probe.bind(("", port))
        except OSError as exc:
            raise PipelineError(
                f"rendezvous port {port} on this node ({socket.gethostname()}) is taken ({exc.strerror}): another "
                "program, or an earlier torchrun still running, holds it. Stop it, or choose a free port (RDZV_PORT "
                "for the Slurm script, --rdzv-endpoint HOST:PORT for torchrun)") from None


def check_client(host: str, port: int, wait_s: float) -> None:
    """On the other nodes: the endpoint accepts within `wait_s` and answers as a TCPStore."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((host, port), timeout=5).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise PipelineError(
                    f"rendezvous {host}:{port}: nothing answers after {wait_s:g} s ({exc.strerror or exc}); is the "
                    "first node up and its torchrun started, and does this node reach that address?") from None
            time.sleep(1)
    answered: list[object] = []

    def connect() -> None:
        from torch.distributed import TCPStore

        try:
            TCPStore(host, port, is_master=False, timeout=timedelta(seconds=ANSWER_S)).check(["mnist-pipeline"])
            answered.append(True)
        except Exception as exc:  # the store's own error, reported below
            answered.append(exc)

    thread = threading.Thread(target=connect, daemon=True)  # abandoned if it hangs: the process exits
    thread.start()
    thread.join(ANSWER_S + 5)
    if not answered or answered[0] is not True:
        detail = f" ({answered[0]})" if answered else ""
        raise PipelineError(
            f"rendezvous {host}:{port} accepts connections but does not answer as torchrun's store{detail}: another "
            "program holds that port on the first node. Stop it, or choose a free port on every node")
