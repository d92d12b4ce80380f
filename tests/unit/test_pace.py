"""Bandwidth caps (storage/pace.py) and the rates the flags take (config.parse_rate): the token
bucket's arithmetic on a fake clock and across threads on the real one, and Paced over a real
folder: every byte charged, streamed reads in small pieces, retries charged again."""
from __future__ import annotations

import threading
import time

import pytest

from helpers.storage_contract import FailFirst
from volunteer_rl.config import VolunteerConfig, parse_rate
from volunteer_rl.errors import ConfigError
from volunteer_rl.storage.base import Transient
from volunteer_rl.storage.local import LocalStorage
from volunteer_rl.storage.pace import (BURST_SECONDS, MAX_PIECE, MIN_PIECE, Paced, TokenBucket,
                                       paced, rate_text)
from volunteer_rl.storage.retry import Retrying

# --- the rates the flags take ------------------------------------------------------------------


@pytest.mark.parametrize("text,rate", [
    ("0", 0), ("250000", 250_000), ("500k", 500_000), ("500K", 500_000), ("500kB", 500_000),
    ("2M", 2_000_000), ("2m", 2_000_000), ("1.5MB", 1_500_000), (".5M", 500_000),
    ("1G", 10**9), ("10KiB", 10 * 1024), ("10MiB", 10 * 2**20), ("2MiB/s", 2 * 2**20),
    ("1GiB", 2**30), (" 3 MB ", 3_000_000), ("1.5 kB/s", 1500)])
def test_a_rate_is_bytes_per_second_si_units_by_1000_binary_by_1024(text, rate):
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text,why", [
    ("8Mb", "a lowercase b is bits"), ("-1", "not '-1'"), ("abc", "not 'abc'"), ("", "not ''"),
    ("1e6", "not '1e6'"), ("2 M B", "not '2 M B'"), ("5T", "not '5T'"), ("0.4", "under 1 byte"),
    ("2MiBs", "not '2MiBs'")])
def test_anything_else_is_one_line_saying_what_a_rate_is(text, why):
    with pytest.raises(ValueError) as e:
        parse_rate(text)
    assert why in str(e.value) and "500k, 2M, 1.5MB or 10MiB" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_volunteer_settings_refuse_a_bad_rate_naming_the_flag():
    assert VolunteerConfig(bucket="b").max_download_rate == "0"  # default: no cap
    with pytest.raises(ConfigError, match=r"^--max-upload-rate: use bytes per second"):
        VolunteerConfig(bucket="b", max_upload_rate="fast")


def test_rates_are_told_in_si_units():
    assert [rate_text(r) for r in (12, 500_000, 2_000_000, 10 * 2**20)] == \
        ["12 B/s", "500 kB/s", "2 MB/s", "10.5 MB/s"]


# --- the token bucket --------------------------------------------------------------------------

class FakeTime:
    def __init__(self):
        self.now, self.slept = 100.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_bucket_lends_its_burst_then_makes_a_taker_wait_for_the_rest():
    t = FakeTime()
    b = TokenBucket(1000, burst=100, clock=t.clock, sleep=t.sleep)
    assert b.take(100) == 0  # the saved-up burst
    assert b.take(500) == pytest.approx(0.5)  # then the rate: 500 bytes, half a second
    assert b.take(0) == 0
    t.now += 10  # idle: it saves up to its burst, never more
    assert b.take(100) == 0 and b.take(1000) == pytest.approx(1.0)
    assert sum(t.slept) == pytest.approx(1.5)


def test_the_default_burst_is_a_tenth_of_a_second_and_pieces_a_quarter_within_bounds():
    assert TokenBucket(1_000_000).burst == 1_000_000 * BURST_SECONDS
    assert TokenBucket(2_000_000).piece_bytes() == 500_000
    assert TokenBucket(1000).piece_bytes() == MIN_PIECE
    assert TokenBucket(10**12).piece_bytes() == MAX_PIECE
    with pytest.raises(ValueError):
        TokenBucket(0)


def test_threads_taking_together_keep_to_the_rate_between_them():
    """The heartbeat thread and the main thread share the volunteer's caps."""
    rate, threads, each, piece = 400_000, 4, 10, 20_000
    b = TokenBucket(rate)
    start = time.perf_counter()
    workers = [threading.Thread(target=lambda: [b.take(piece) for _ in range(each)])
               for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - start
    least = (threads * each * piece - b.burst) / rate  # 1.9 s
    assert least * 0.98 <= seconds <= least + 1.0, seconds


# --- Paced over a real folder ------------------------------------------------------------------

class Counting:
    """A token bucket stand-in that only records what is taken."""

    def __init__(self, rate: float = 1_000_000):
        self.rate, self.taken = rate, []

    def take(self, n: int) -> float:
        self.taken.append(n)
        return 0.0

    def piece_bytes(self) -> int:
        return TokenBucket(self.rate).piece_bytes()


def test_every_read_and_write_is_charged_to_its_own_way(tmp_path):
    down, up = Counting(), Counting()
    s = Paced(LocalStorage(tmp_path), down, up)
    s.write("a", b"x" * 10)
    s.create("b", b"y" * 20)
    etag = s.write_if_match("c", b"z" * 30, None)
    s.create_from("d", lambda f: (f.write(b"1" * 300_000), f.write(b"2" * 5)))
    assert sum(up.taken) == 10 + 20 + 30 + 300_005 and max(up.taken) <= 250_000
    assert down.taken == []
    assert s.read("a") == b"x" * 10
    assert s.read_if_changed("c", None)[0] == b"z" * 30
    assert s.read_if_changed("c", etag) == (None, etag)  # not changed: nothing came
    assert s.exists("a") and s.size("d") == 300_005 and s.list("") == ["a", "b", "c", "d"]
    assert sum(down.taken) == 40 and sum(up.taken) == 300_065  # listings carry no object
    assert LocalStorage(tmp_path).read("d") == b"1" * 300_000 + b"2" * 5


def test_a_streamed_read_comes_in_pieces_of_its_cap_seen_before_they_are_paid(tmp_path):
    data = bytes(range(256)) * 4096  # 1 MiB
    LocalStorage(tmp_path).write("w.bin", data)
    down = Counting(rate=1_000_000)  # pieces of 250 kB
    events = []
    down.take = lambda n: events.append(("paid", n))
    s = Paced(LocalStorage(tmp_path), down)
    buf = bytearray(len(data))
    s.read_into("w.bin", memoryview(buf), lambda off, piece: events.append(("seen", off, len(piece))))
    assert bytes(buf) == data
    seen = [e for e in events if e[0] == "seen"]
    assert len(seen) == 5 and max(n for _, _, n in seen) == 250_000
    assert events[::2] == seen and [n for _, n in events[1::2]] == [n for _, _, n in seen]


def test_a_retried_read_starts_again_at_zero_and_is_charged_again(tmp_path):
    """The cap sits outside Retrying (as in the volunteer): a retry re-reads, and pays."""
    data = b"q" * 600_000
    LocalStorage(tmp_path).write("w.bin", data)
    down = Counting()
    flaky = FailFirst(LocalStorage(tmp_path), failures=1)
    s = Paced(Retrying(flaky, sleep=lambda s: None), down)
    offsets = []
    s.read_into("w.bin", memoryview(bytearray(len(data))), lambda off, p: offsets.append(off))
    assert offsets[0] == 0 and sum(down.taken) == len(data) and flaky.calls["read_into"] == 2

    class FailMidway(LocalStorage):
        """Fails once after its first piece, as a dropped connection does."""
        failed = False

        def read_into(self, key, buf, on_chunk=None, piece=None):
            def chunk(off, view):
                on_chunk(off, view)
                if not FailMidway.failed:
                    FailMidway.failed = True
                    raise Transient(f"{key}: connection reset (injected)")
            return super().read_into(key, buf, chunk, piece=piece)

    down, offsets = Counting(), []
    s = Paced(Retrying(FailMidway(tmp_path), sleep=lambda s: None), down)
    s.read_into("w.bin", memoryview(bytearray(len(data))), lambda off, p: offsets.append(off))
    assert offsets == [0, 0, 250_000, 500_000]
    assert sum(down.taken) == len(data) + 250_000  # the first piece crossed the link twice


def test_no_cap_is_the_storage_itself(tmp_path):
    inner = LocalStorage(tmp_path)
    assert paced(inner, 0, 0) is inner
    both = paced(inner, 2_000_000, 0)
    assert isinstance(both, Paced) and both.upload is None and both.uri == inner.uri
    assert both.caps() == "downloads at most 2 MB/s, uploads not capped"
