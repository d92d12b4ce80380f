"""storage/retry.py: a line per retry, a bucket that never answered gets PATIENCE_SECONDS,
and a stop cuts the wait short. The real processes against a closed port are
tests/integration/test_unreachable_storage.py."""
from __future__ import annotations

import pytest

from volunteer_rl.storage.base import NotFound, Transient
from volunteer_rl.storage.retry import Retrying


class Down:
    """A bucket whose reads fail as Transient until `up` is set; `answers` reads are NotFound."""
    uri = "down://b"

    def __init__(self):
        self.calls, self.up = 0, False

    def read(self, key, max_bytes=None):
        self.calls += 1
        if not self.up:
            raise Transient(f"{key}: read failed in {self.uri}: connection refused")
        raise NotFound(f"{key}: not found")


class Clock:
    """Each wait moves the time on by what was slept, plus `per_try` for the try itself."""

    def __init__(self, per_try: float):
        self.now, self.per_try = 0.0, per_try

    def sleep(self, seconds: float) -> bool:
        self.now += seconds + self.per_try
        return False


def test_each_retry_is_a_line_with_its_wait():
    lines, clock = [], Clock(0.0)
    r = Retrying(Down(), attempts=3, sleep=clock.sleep, log=lines.append, clock=lambda: clock.now)
    with pytest.raises(Transient, match=r"gave up after 3 tries"):
        r.read("manifest.json")
    assert len(lines) == 2
    assert lines[0].startswith("manifest.json: read failed in down://b: connection refused; "
                               "try 2 of 3 in ") and lines[0].endswith("s")


def test_a_bucket_that_never_answered_gets_its_patience_then_one_try_a_call():
    down, lines, clock = Down(), [], Clock(per_try=10.0)  # 10 s a try: an unreachable host
    r = Retrying(down, attempts=50, sleep=clock.sleep, patience=30.0, log=lines.append,
                 clock=lambda: clock.now)
    with pytest.raises(Transient, match=r"no answer from the bucket in \d+s; gave up"):
        r.read("manifest.json")
    assert down.calls == 4 and clock.now < 45  # not 50 tries of 10 s
    with pytest.raises(Transient, match="no answer from the bucket"):
        r.read("fleet.json")
    assert down.calls == 5  # the outage goes on: one try


def test_a_bucket_that_answered_once_gets_every_attempt():
    down, clock = Down(), Clock(per_try=10.0)
    r = Retrying(down, attempts=6, sleep=clock.sleep, patience=30.0, log=lambda line: None,
                 clock=lambda: clock.now)
    down.up = True
    with pytest.raises(NotFound):  # an answer: the bucket is there
        r.read("manifest.json")
    down.up, down.calls = False, 0
    with pytest.raises(Transient, match="gave up after 6 tries"):
        r.read("manifest.json")
    assert down.calls == 6


def test_a_stop_ends_the_wait_and_the_call():
    down, lines = Down(), []
    r = Retrying(down, attempts=5, sleep=lambda seconds: True, log=lines.append)
    with pytest.raises(Transient, match=r"\(stopping: not tried again\)"):
        r.read("manifest.json")
    assert down.calls == 1 and len(lines) == 1


def test_a_bucket_that_answered_keeps_its_tries_after_a_stop():
    """The trainer's last publish after a SIGTERM still gets its retries."""
    down = Down()
    r = Retrying(down, attempts=3, sleep=lambda seconds: True, log=lambda line: None)
    down.up = True
    with pytest.raises(NotFound):
        r.read("manifest.json")
    down.up, down.calls = False, 0
    with pytest.raises(Transient, match="gave up after 3 tries"):
        r.read("manifest.json")
    assert down.calls == 3
