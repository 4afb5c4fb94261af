"""The outbox under the tracking calls: kept on disk first, sent in order, never lost."""

import threading

from pipeline.outbox import Outbox, replay


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
