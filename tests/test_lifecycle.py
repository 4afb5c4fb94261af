"""A stop signal unwinds the process like an error; the cleanup after it is not cut short; the
process's own handlers come back afterwards."""

import os
import signal
import threading

import pytest

from pipeline.tracking.runs import until_done

pytestmark = pytest.mark.fast  # the inner loop's tier: `make test-fast`


class RecordingRuns:
    """Stands in for tracking's runs: records how they were ended, and can signal itself meanwhile."""

    def __init__(self, signal_while_ending=None):
        self.ended, self.signal_while_ending = [], signal_while_ending

    def start(self):  # a continued training's runs would be reopened here
        pass

    def end(self, status, wait_s=None):
        if self.signal_while_ending:
            os.kill(os.getpid(), self.signal_while_ending)  # a second `docker stop`, or Ctrl-C again
        self.ended.append(status)


def test_sigterm_unwinds_and_the_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    runs = RecordingRuns()
    with pytest.raises(SystemExit) as info:
        with until_done(runs):
            os.kill(os.getpid(), signal.SIGTERM)
    assert info.value.code == 128 + signal.SIGTERM and runs.ended == ["FAILED"]
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_does_not_cut_the_ending_short(second):
    runs = RecordingRuns(signal_while_ending=second)
    with pytest.raises(KeyboardInterrupt):
        with until_done(runs):
            os.kill(os.getpid(), signal.SIGINT)
    assert runs.ended == ["FAILED"]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_that_arrives_twice_does_not_cut_short_the_cleanup_on_the_way_out(stop):
    """A job-wide signal reaches a warm server's fork from the kill and again from its client."""
    runs, cleaned = RecordingRuns(), []
    with pytest.raises((SystemExit, KeyboardInterrupt)):
        with until_done(runs):
            try:
                os.kill(os.getpid(), stop)
            finally:
                os.kill(os.getpid(), stop)  # the same signal, forwarded
                cleaned.append("workers stopped")
    assert cleaned == ["workers stopped"] and runs.ended == ["FAILED"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failure_to_end_the_runs_does_not_hide_the_first_error():
    class Unreachable(RecordingRuns):
        def end(self, status, wait_s=None):
            raise ConnectionError("tracking server gone")

    with pytest.raises(ValueError, match="the real problem"):
        with until_done(Unreachable()):
            raise ValueError("the real problem")


def test_in_a_thread_no_handler_is_touched():
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def work():
        with until_done(RecordingRuns()):
            seen["handler"] = signal.getsignal(signal.SIGTERM)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["handler"] == before
