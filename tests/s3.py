"""A real S3-compatible server on 127.0.0.1 for the storage tests: moto's `moto_server` (from PyPI,
in requirements-dev.txt), reached through a relay that a test can switch off and on again, so that
an outage refuses connections as a stopped server does while the bucket keeps what it holds
(moto keeps its objects in memory: a restarted server would come back empty).

The credentials are made up for each server and meant to be looked for: a test that finds the
secret anywhere it must not be (a log, an argument list, an MLflow param or tag) fails.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path

from tests.conftest import free_port, subprocess_env
from tests.hosts import wait_until

BUCKET = "mnist-team"


class Relay:
    """Forwards TCP connections from `port` to `target`; `off()` closes the listener and every
    open connection (a client then gets "connection refused"), `on()` listens again."""

    def __init__(self, target: int) -> None:
        self.target, self.port = target, free_port()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def on(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def off(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it, which holds it open
            listener.close()
        with self._lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by off()
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the server is gone: so is this connection
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # switched off meanwhile: this one goes too
                    client.close()
                    upstream.close()
                    continue
                self._open |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._open -= {source, sink}


class S3Server:
    """moto_server on 127.0.0.1 behind a Relay, with bucket BUCKET made; `env` is what a client
    (or the MLflow server) needs to reach it: the endpoint and this server's own credentials."""

    def __init__(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.home, self.port = home, free_port()
        self.key_id = "AKIA" + secrets.token_hex(8).upper()
        self.secret = secrets.token_urlsafe(30)
        self._log = (home / "s3.log").open("w")
        self.proc = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(self.port)], cwd=home,
                                     env=subprocess_env(), stdout=self._log, stderr=subprocess.STDOUT)
        self.relay = Relay(self.port)
        self.relay.on()
        self.endpoint = f"http://127.0.0.1:{self.relay.port}"
        wait_until(self._answers, "moto_server answering", timeout=60, interval=0.3,
                   diagnose=lambda: (home / "s3.log").read_text())
        self.client().create_bucket(Bucket=BUCKET)

    def _answers(self) -> bool:
        assert self.proc.poll() is None, (self.home / "s3.log").read_text()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/moto-api/", timeout=2)
            return True
        except OSError:
            return False

    @property
    def credentials(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_DEFAULT_REGION": "us-east-1"}

    @property
    def env(self) -> dict[str, str]:
        """For MLflow (its server, or clients that write a bucket themselves): MLflow reads its own
        endpoint variable; boto3 and DVC read the credentials."""
        return {**self.credentials, "MLFLOW_S3_ENDPOINT_URL": self.endpoint}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key_id,
                            aws_secret_access_key=self.secret, region_name="us-east-1")

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def stop(self) -> None:
        self.relay.off()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


class Cmdlines:
    """Every process's argument list, read from /proc every 0.2 s while it runs: what `ps` would
    show another user of the machine."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "Cmdlines":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            for proc in Path("/proc").iterdir():
                if proc.name.isdigit():
                    try:
                        self.seen.add((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
                    except OSError:
                        pass
            self._stop.wait(0.2)
