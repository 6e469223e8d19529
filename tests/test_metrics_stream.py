"""The metrics' writer thread (`metrics/stream.py`): the training thread's lines reach their
file in order without a system call of its own; `flush` puts every row logged so far on disk
(what a checkpoint relies on); a failed write surfaces as one MetricsError line."""

from __future__ import annotations

import io
import json
import threading

import pytest

from asyncrl.config.schema import LoggingConfig
from asyncrl.metrics import MetricsError, MetricsLogger
from asyncrl.metrics.stream import BackgroundStream


class Gated(io.StringIO):
    """A target whose writes wait for `gate` (a slow disk or pipe) and count their calls."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered, self.writes = threading.Event(), threading.Event(), 0

    def write(self, text: str) -> int:
        self.entered.set()
        assert self.gate.wait(30), "test gate never opened"
        self.writes += 1
        return super().write(text)


def test_writes_reach_the_target_in_order_off_the_calling_thread():
    target = Gated()
    stream = BackgroundStream(target, "test")
    stream.write("a\n")  # returns at once although the target blocks
    assert target.entered.wait(30)
    for i in range(50):  # queued behind the blocked write
        stream.write(f"{i}\n")
    assert target.getvalue() == ""
    target.gate.set()
    stream.drain()
    assert target.getvalue() == "a\n" + "".join(f"{i}\n" for i in range(50))
    assert target.writes <= 3  # what queued meanwhile left in one write, not fifty
    stream.close()
    assert not target.closed  # a stream it does not own (stdout) stays open


def test_a_failed_write_is_raised_by_the_next_call_and_nothing_after_it_is_written():
    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    stream = BackgroundStream(Full(), "metrics.jsonl")
    stream.write("row 1\n")
    with pytest.raises(MetricsError, match=r"writing metrics.jsonl failed: .*No space left"):
        stream.drain()
    with pytest.raises(MetricsError, match="No space left"):
        stream.write("row 2\n")
    with pytest.raises(MetricsError, match="No space left"):
        stream.close()
    closed = BackgroundStream(io.StringIO(), "x")
    closed.close()
    with pytest.raises(MetricsError, match="x written after close"):
        closed.write("late\n")


def test_close_drains_and_closes_an_owned_target(tmp_path):
    file = (tmp_path / "out.txt").open("w", encoding="utf-8")
    stream = BackgroundStream(file, "out.txt", owns_target=True)
    for i in range(100):
        stream.write(f"{i}\n")
    stream.close()
    assert file.closed
    assert (tmp_path / "out.txt").read_text().splitlines() == [str(i) for i in range(100)]
    stream.close()  # a second close does nothing


def test_logger_flush_puts_every_logged_row_on_disk(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False, plots=False), stream=out)
    for step in range(1, 21):
        logger.log(step, {"version": step})
    logger.flush()  # as the loop does before a checkpoint
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 21))
    assert len(out.getvalue().splitlines()) == 20  # the console's lines too
    logger.close()
