"""The outbox under the tracking calls: kept on disk first, sent in order, never lost."""

import json
import threading

import pytest

from pipeline.tracking.outbox import Outbox, replay

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`


class Flaky:
    """A delivery that fails while `down` is set, and records what went through, in order."""

    def __init__(self):
        self.down = threading.Event()
        self.got = []

    def __call__(self, op):
        if self.down.is_set():
            raise ConnectionError("server away")
        self.got.append(op["n"])


def test_put_never_waits_and_everything_arrives_in_order_once_the_server_is_back(tmp_path):
    server = Flaky()
    server.down.set()
    box = Outbox(tmp_path / "box", "rank-0", server, target="http://server")
    for n in range(5):
        box.put({"n": n})  # returns at once though nothing can be sent
    assert box.drain(0.2) == 5 and server.got == []
    assert len((tmp_path / "box/rank-0.jsonl").read_text().splitlines()) == 5  # on disk meanwhile
    server.down.clear()
    assert box.drain(30) == 0 and server.got == [0, 1, 2, 3, 4]
    box.close()
    assert not (tmp_path / "box").exists()  # all sent: nothing kept, no folder left


def test_what_a_process_could_not_send_survives_it_and_is_sent_later(tmp_path):
    server = Flaky()
    box = Outbox(tmp_path / "box", "rank-1", server, target="http://server")
    box.put({"n": 0})
    assert box.drain(30) == 0
    server.down.set()
    box.put({"n": 1})
    box.put({"n": 2})
    assert box.drain(0.2) == 2
    box.close()  # the process ends with two calls unsent
    assert (tmp_path / "box/rank-1.sent").read_text().strip() == "1"

    later = Flaky()
    assert replay(tmp_path / "box/rank-1.jsonl", later) == 2 and later.got == [1, 2]  # only what was not sent
    assert not (tmp_path / "box").exists()  # nothing left: no folder either


def test_a_restarted_process_sends_the_earlier_attempts_leftovers_first(tmp_path):
    server = Flaky()
    server.down.set()
    first = Outbox(tmp_path / "box", "rank-0", server, target="http://server")
    first.put({"n": 0})
    first.close()
    server.down.clear()
    second = Outbox(tmp_path / "box", "rank-0", server, target="http://server")
    second.put({"n": 1})
    assert second.drain(30) == 0 and server.got == [0, 1]


def test_a_disk_that_cannot_keep_them_leaves_the_calls_in_memory_without_stopping(tmp_path):
    server = Flaky()
    box = Outbox(tmp_path / "box", "rank-0", server, target="http://server")
    (tmp_path / "box/rank-0.jsonl").mkdir()  # appending to it fails, as on a full disk
    box.put({"n": 0})
    box.put({"n": 1})
    assert box.disk_error is not None
    assert box.drain(30) == 0 and server.got == [0, 1]  # still sent, in order


class Refusing(Flaky):
    """A server that says no (a read-only artifact store, a 403) to every call."""

    def __call__(self, op):
        self.got.append(op["n"])
        raise PermissionError(13, "Read-only file system")


def test_a_refusal_stops_sending_at_once_with_the_servers_reason(tmp_path):
    import time

    server = Refusing()
    box = Outbox(tmp_path / "box", "rank-0", server, target="http://server", refused=lambda exc: True)
    box.put({"n": 0})
    box.put({"n": 1})
    started = time.monotonic()
    assert box.drain(60) == 2 and time.monotonic() - started < 30  # not the outage wait (60 s)
    assert "Read-only file system" in str(box.refusal) and server.got == [0]  # asked once, not again
    box.close()
    assert len((tmp_path / "box/rank-0.jsonl").read_text().splitlines()) == 2  # kept for send-runs


def test_an_outage_is_still_waited_for(tmp_path):
    server = Flaky()
    server.down.set()
    box = Outbox(tmp_path / "box", "rank-0", server, target="http://server", refused=lambda exc: False)
    box.put({"n": 0})
    assert box.drain(0.5) == 1 and box.refusal is None
    server.down.clear()
    assert box.drain(30) == 0


def test_a_damaged_line_is_reported_as_file_and_line_and_the_good_lines_still_go(tmp_path, caplog):
    folder = tmp_path / "box"
    folder.mkdir()
    (folder / "rank-0.jsonl").write_text('{"n": 0}\n{"n": 1, "trunc\n{"n": 2}\n')
    server = Flaky()
    assert replay(folder / "rank-0.jsonl", server) == 2 and server.got == [0, 2]
    assert f"{folder / 'rank-0.jsonl'}:2: skipped" in caplog.text


def test_the_checker_refuses_what_a_training_never_asks(tmp_path, caplog):
    from pipeline.tracking.delivery import op_checker

    mode_dir = tmp_path / "models/single"
    (mode_dir / "logs").mkdir(parents=True)
    (mode_dir / "logs/rank-0.log").write_text("log")
    (tmp_path / "secret").write_text("ssh key")
    run = "0123456789abcdef0123456789abcdef"
    lines = [{"op": "artifact", "run": run, "path": str(mode_dir / "logs/rank-0.log")},
             {"op": "artifact", "run": run, "path": str(tmp_path / "secret")},
             {"op": "artifact", "run": run, "path": str(mode_dir / "../../secret")},
             {"op": "model", "run": run, "file": "/etc/passwd"},
             {"op": "shell", "run": run},
             {"op": "end", "run": "../../x", "status": "FINISHED"},
             {"op": "end", "run": run, "status": "RUNNING"},
             {"op": "end", "run": run, "status": "FINISHED"}]
    (mode_dir / "tracking-outbox").mkdir()
    path = mode_dir / "tracking-outbox/rank-0.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    got = []
    assert replay(path, got.append, op_checker(mode_dir)) == 2
    assert [op["op"] for op in got] == ["artifact", "end"] and got[0]["path"].endswith("rank-0.log")
    for number in range(2, 8):
        assert f"{path}:{number}: skipped" in caplog.text
    assert "is outside" in caplog.text and "unknown operation 'shell'" in caplog.text


def test_refusals_and_outages_as_mlflow_raises_them(tmp_path):
    """The real exceptions: a run the store does not hold, and a server that is not there."""
    import errno

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, TEMPORARILY_UNAVAILABLE

    from pipeline.tracking.store import refused
    from tests.conftest import free_port

    try:
        MlflowClient(f"sqlite:///{tmp_path / 'm.db'}").get_run("0123456789abcdef0123456789abcdef")
    except MlflowException as exc:
        assert refused(exc)  # no such run: asking again will not create it
    try:
        MlflowClient(f"http://127.0.0.1:{free_port()}").get_run("0123456789abcdef0123456789abcdef")
    except Exception as exc:
        assert not refused(exc)  # nobody there: an outage
    assert refused(OSError(errno.EROFS, "Read-only file system")) and refused(OSError(errno.EDQUOT, "quota"))
    assert not refused(ConnectionResetError()) and not refused(MlflowException("x", error_code=TEMPORARILY_UNAVAILABLE))
    assert refused(MlflowException("x", error_code=PERMISSION_DENIED))


def test_a_line_that_is_not_utf8_is_one_damaged_line_and_discard_always_works(tmp_path, caplog):
    from pipeline.tracking.outbox import discard

    folder = tmp_path / "box"
    folder.mkdir()
    (folder / "rank-0.jsonl").write_bytes(b'{"n": 0}\n\xff\xfe garbage\n{"n": 2}\n')
    server = Flaky()
    assert replay(folder / "rank-0.jsonl", server) == 2 and server.got == [0, 2]
    assert f"{folder / 'rank-0.jsonl'}:2: skipped" in caplog.text
    assert (folder / "rank-0.rejected").read_bytes() == b"\xff\xfe garbage\n"  # kept for a look, not lost
    (folder / "rank-1.jsonl").write_bytes(b"\xff\n\xfe\n")
    assert discard(folder) == 2 and not folder.exists()


def test_the_checker_holds_a_line_to_this_trainings_runs_files_and_registry_name(tmp_path, caplog):
    from pipeline.tracking.delivery import op_checker

    mode_dir = tmp_path / "models/single"
    (mode_dir / "logs").mkdir(parents=True)
    (tmp_path / "secret").write_text("ssh key")
    (mode_dir / "logs/rank-0.log").symlink_to(tmp_path / "secret")  # planted in a shared folder
    ours, other = "0123456789abcdef0123456789abcdef", "f" * 32
    check = op_checker(mode_dir, run_ids=[ours], registered="mnist-cnn")
    model = {"op": "model", "run": ours, "file": str(mode_dir / "model.pt"), "mode": "single", "example": []}
    bad = [({"op": "end", "run": other, "status": "FINISHED"}, "not one of this training's runs"),
           ({"op": "artifact", "run": ours, "path": str(mode_dir / "logs/rank-0.log")}, "symbolic link"),
           ({"op": "metrics", "run": ours}, "metrics must be"),
           ({"op": "metrics", "run": ours, "points": [["loss", float("nan"), 1, 0]]}, "metrics must be"),
           ({**model, "registered": "attacker"}, "registers the model as 'attacker'"),
           ({**model, "mode": "ddp", "registered": "mnist-cnn"}, "a model of mode 'ddp'"),
           ({**model, "registered": "mnist-cnn", "example_dtype": "object"}, "an input example of type 'object'")]
    for line, reason in bad:
        try:
            check(line)
        except ValueError as exc:
            assert reason in str(exc), (line, exc)
        else:
            raise AssertionError(f"accepted {line}")
    check({**model, "registered": "mnist-cnn"})
    check({**model, "registered": "mnist-cnn", "example_dtype": "int64"})  # token ids, say
    check({"op": "metrics", "run": ours, "points": [["loss", 0.5, 1, 0]]})


def test_a_models_input_example_keeps_its_integers_and_a_model_that_fails_on_it_is_refused(tmp_path):
    """A workload whose inputs are token ids (an nn.Embedding first) logs its example as integers,
    and the logged model predicts on integers; floating inputs stay float32, as before (and an op
    from before the type was written down). A model that raises on its own example is a refusal,
    one line naming the file, not an outage to wait out (nothing was asked of the store)."""
    import numpy as np
    import torch

    from pipeline.errors import ConfigError
    from pipeline.tracking import mlflow_model
    from pipeline.tracking.model import example_tensor, log_model
    from pipeline.tracking.store import refused
    from pipeline.config import WorkloadConfig
    from pipeline.workloads import load_workload, recorded

    assert example_tensor({"example": [[1, 2]], "example_dtype": "int64"}).dtype == torch.int64
    assert example_tensor({"example": [[0.5]], "example_dtype": "float64"}).dtype == torch.float32
    assert example_tensor({"example": [[0.5]]}).dtype == torch.float32
    logged = mlflow_model.MnistClassifier()
    logged.model = torch.nn.Embedding(5, 3)
    assert logged.predict(None, np.array([[1, 4]])).shape == (1, 2, 3)
    logged.model = torch.nn.Linear(2, 1)
    assert logged.predict(None, np.array([[1.0, 2.0]], dtype=np.float64)).dtype == np.float32
    workload = WorkloadConfig()  # MNIST's
    network = load_workload(workload).build_model()
    torch.save({"state_dict": network.state_dict(), "workload": recorded(workload)}, tmp_path / "model.pt")
    op = {"op": "model", "run": "0" * 32, "file": str(tmp_path / "model.pt"), "mode": "single",
          "example": [[1.0, 2.0]], "example_dtype": "float32"}  # not an image: MNIST's network cannot take it
    with pytest.raises(ConfigError, match=r"model.pt: the model does not run on its input example") as caught:
        log_model(None, "", op)
    assert refused(caught.value)


def test_refusals_and_outages_as_an_s3_bucket_answers_them():
    """What MLflow's S3 uploads raise (boto3's S3UploadFailedError, raised while handling botocore's
    ClientError, which keeps the bucket's HTTP status in a dict): a bucket that says no (no right,
    no such bucket) is a refusal; one that is busy, slow or not answering is an outage, whatever
    status its busy answer has."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError, EndpointConnectionError

    from pipeline.tracking.store import http_status, refused

    def upload_failed(status: int, code: str) -> S3UploadFailedError:
        try:
            try:
                raise ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                                  "PutObject")
            except ClientError as exc:
                raise S3UploadFailedError(f"Failed to upload model.pt to bucket/model.pt: {exc}")
        except S3UploadFailedError as exc:
            return exc

    assert http_status(upload_failed(403, "AccessDenied")) == 403 and refused(upload_failed(403, "AccessDenied"))
    assert refused(upload_failed(404, "NoSuchBucket"))
    assert not refused(upload_failed(503, "SlowDown")) and not refused(upload_failed(500, "InternalError"))
    assert not refused(EndpointConnectionError(endpoint_url="http://127.0.0.1:9/bucket/model.pt"))
    assert not refused(upload_failed(400, "RequestTimeout")) and not refused(upload_failed(409, "OperationAborted"))
    assert refused(upload_failed(400, "InvalidArgument"))
    assert http_status(RuntimeError("403")) is None
