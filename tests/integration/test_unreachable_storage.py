"""Real `vrl` processes against an S3 endpoint nobody listens on (127.0.0.1, a closed port).

On main `vrl status` said nothing for 219 s before its error, and a volunteer said nothing
at all until signalled, then took 263 s to exit: botocore's 8 silent tries under each of
Retrying's 5. Now the first failed try is a line naming the object, the bucket and the
endpoint, each retry a line with its wait, a one-shot command gives up within the patience
of storage/retry.py, and a stop is honoured within seconds.
"""
from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

from helpers.vrlproc import FAKE_AWS_CREDENTIALS, Proc, wait_for

# Hang guards, generous for a busy machine and still far below the silences this file was
# written against (219 s before status's error, 263 s to stop a volunteer).
FIRST_LINE_SECONDS = 90.0  # start-up, then botocore's own tries of the first request
STATUS_SECONDS = 150.0  # start-up, then PATIENCE_SECONDS (30) of tries
STOP_SECONDS = 120.0  # the request in flight ends its botocore tries; the last heartbeat gets one


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unreachable(tmp_path: Path, name: str, *args: str) -> tuple[Proc, str]:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    proc = Proc([*args, "--bucket", "s3://nobody/run", "--endpoint-url", endpoint],
                tmp_path / f"{name}.log", tmp_path, FAKE_AWS_CREDENTIALS)
    return proc, endpoint


def first_warning(proc: Proc) -> str:
    started = time.time()
    line = wait_for(lambda: next((x for x in proc.text().splitlines() if x.startswith("warning: ")),
                                 None), FIRST_LINE_SECONDS, "the first warning")
    print(f"first warning after {time.time() - started:.1f}s: {line}")
    return line


def test_status_says_so_at_once_and_gives_up_within_its_patience(tmp_path):
    status, endpoint = unreachable(tmp_path, "status", "status")
    try:
        line = first_warning(status)
        assert "manifest.json" in line and "s3://nobody/run" in line and endpoint in line
        assert line.endswith("s") and " in " in line  # the wait before the next try
        code = status.wait(STATUS_SECONDS)
    finally:
        status.kill()
    lines = status.text().strip().splitlines()
    assert code == 1 and lines[-1].startswith("error: ") and endpoint in lines[-1], lines
    assert all(x.startswith("warning: ") for x in lines[:-1]) and "Traceback" not in status.text()


def test_volunteer_says_so_and_stops_promptly(tmp_path):
    volunteer, endpoint = unreachable(tmp_path, "volunteer", "volunteer", "--threads", "1",
                                      "--work-dir", str(tmp_path / "vw"))
    try:
        assert endpoint in first_warning(volunteer)
        sent = time.time()
        volunteer.p.send_signal(signal.SIGTERM)
        code = volunteer.wait(STOP_SECONDS)
    finally:
        volunteer.kill()
    print(f"volunteer exited {time.time() - sent:.1f}s after SIGTERM")
    assert code == 0 and "Traceback" not in volunteer.text()
    assert volunteer.text().strip().splitlines()[-1].endswith("stopped after uploading 0 groups")
