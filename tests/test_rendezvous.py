"""The launchers we ship fail within seconds, saying why, where torchrun alone hangs: another
program holding the rendezvous port (a client then waits inside TCPStore's handshake, with no
timeout and deaf to Ctrl-C). Run as shipped: the TrainJob's script and docs/multi-node.md's torchrun line."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest
import yaml

from tests.conftest import ROOT, free_port, scaled, subprocess_env

HELD = "accepts connections but does not answer as torchrun's store"


@dataclass
class Squatter:
    port: int
    held: list  # the connections it took, in order


@pytest.fixture
def squatter():
    """Another program on the rendezvous port: it takes connections and says nothing."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield Squatter(server.getsockname()[1], held)
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def timed(cmd, **env) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(cmd, env=subprocess_env(**env), capture_output=True, text=True, timeout=120, cwd=ROOT)
    return result, time.monotonic() - started


def trainjob_script() -> str:
    job = [d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/trainjob.yaml").read_text())
           if d["kind"] == "TrainJob"][0]
    return job["spec"]["trainer"]["command"][2]


@pytest.mark.parametrize("node_rank, message", [("1", HELD), ("0", "is taken (Address already in use)")])
def test_the_trainjob_fails_in_seconds_on_a_held_rendezvous_port(squatter, node_rank, message):
    result, took = timed(["sh", "-ec", trainjob_script()], PET_NODE_RANK=node_rank, PET_MASTER_ADDR="127.0.0.1",
                         PET_MASTER_PORT=str(squatter.port), PET_NNODES="2", PET_NPROC_PER_NODE="1")
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert took < 15 + scaled(30) and "torch.distributed.elastic" not in result.stderr  # torchrun never started


def test_the_docs_torchrun_line_fails_in_seconds_on_a_held_port(squatter):
    """docs/multi-node.md's torchrun command, as a user pastes it."""
    block = re.search(r"```sh\n# on node-a.*?\n(mnist-pipeline rendezvous-check.*?)```", (ROOT / "docs/multi-node.md").read_text(),
                      re.S)[1]
    # node-b's form of it (as the comment says), against a rendezvous address another program holds
    line = block.replace("10.0.0.1:29400", f"127.0.0.1:{squatter.port}").replace("--host", "--client")
    line = line.replace("is_host=1", "is_host=0").replace("--local-addr 10.0.0.1", "--local-addr 127.0.0.1")
    result, took = timed(["bash", "-c", line])
    assert result.returncode != 0 and HELD in result.stderr and took < 15 + scaled(30), result.stderr


def test_the_check_lets_a_real_rendezvous_through_and_waits_for_a_late_host():
    from torch.distributed import TCPStore

    port = free_port()
    late = threading.Timer(3, lambda: stores.append(TCPStore("127.0.0.1", port, is_master=True,
                                                                  wait_for_workers=False)))
    stores: list = []
    late.start()  # the first node comes up after this one
    result, took = timed(["mnist-pipeline", "rendezvous-check", "--endpoint", f"127.0.0.1:{port}", "--wait", "60"])
    late.join()
    assert result.returncode == 0 and took >= 3, result.stderr
    result, _ = timed(["mnist-pipeline", "rendezvous-check", "--endpoint", f"127.0.0.1:{free_port()}", "--host"])
    assert result.returncode == 0, result.stderr


@pytest.mark.fast
@pytest.mark.alone
def test_ctrl_c_ends_the_check_at_once(squatter):
    proc = subprocess.Popen(["mnist-pipeline", "rendezvous-check", "--endpoint", f"127.0.0.1:{squatter.port}"],
                            env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    # Inside the wait for the store's answer, however long the imports took: the check's probe
    # connection, then the store's own.
    deadline = time.monotonic() + scaled(30)
    while len(squatter.held) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(squatter.held) < 2 or proc.poll() is not None:
        proc.kill()
        pytest.fail(f"the check never reached the store's handshake: {proc.communicate()}")
    proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    # Without Ctrl-C reaching it, the check would wait out the store's ANSWER_S (10 s) or hang:
    # well under that is "at once" on any host, however busy.
    proc.wait(timeout=30)
    assert time.monotonic() - started < 7 and proc.returncode != 0
