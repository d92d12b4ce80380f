"""A real `vrl volunteer`, started without --id, stopped and started again from the same work
dir: it comes back under the id it saved there (one heartbeat, one row in `vrl status`, no
offline ghost), and it sums its uploads up in one line per interval instead of a line per
shard (progress.STATUS_SECONDS; --log-shards brings those back)."""
from __future__ import annotations

import re
import time

from conftest import TEMPLATE_VERSION

from helpers.grants import deal, wait_for_ask
from helpers.vrlproc import Proc, wait_for
from volunteer_rl.progress import STATUS_SECONDS
from volunteer_rl.protocol import layout


def shards(bucket, vid: str) -> list:
    folder = bucket / layout.rollout_volunteer_prefix(TEMPLATE_VERSION, vid)
    return sorted(folder.glob("*.jsonl.gz")) if folder.exists() else []


def test_a_restarted_volunteer_keeps_its_id_and_logs_a_summary_not_a_line_per_shard(template, tmp_path):
    bucket = template.copy(tmp_path / "bucket")
    cmd = ["volunteer", "--bucket", str(bucket), "--trust-key", f"{template.key}.pub",
           "--threads", "1", "--prompts-per-batch", "4", "--shard-groups", "4",
           "--heartbeat-seconds", "1", "--poll-seconds", "0.2", "--work-dir", str(tmp_path / "vw")]
    started = time.time()
    first = Proc(cmd, tmp_path / "first.log", tmp_path)
    try:
        vid = wait_for(lambda: re.search(r"^volunteer (\S+) on ", first.text(), re.M), 120,
                       "the volunteer's first line").group(1)
        # No trainer runs: once it asked for numbers, its grant is dealt as a trainer would
        wait_for_ask(bucket, vid, TEMPLATE_VERSION, 120)
        deal(bucket, template.key, template.run_id, vid, TEMPLATE_VERSION, None, blocks=2)
        wait_for(lambda: len(shards(bucket, vid)) >= 3, 180, "three shards")
        assert first.terminate() == 0, first.text()[-3000:]
    finally:
        first.kill()
    seconds = time.time() - started
    uploaded = len(shards(bucket, vid))

    second = Proc(cmd, tmp_path / "second.log", tmp_path)
    try:
        wait_for(lambda: "now on v2 " in second.text(), 120, "the restarted volunteer on v2")
        assert second.terminate() == 0, second.text()[-3000:]
    finally:
        second.kill()

    wrong = []  # both halves are checked, and each one's failure is told
    log, again = first.text(), second.text()
    if f"new volunteer id {vid}, saved in " not in log or f"volunteer {vid} on " not in again \
            or "new volunteer id" in again:
        wrong.append(f"the restart did not come back as {vid}")
    heartbeats = [p.stem for p in (bucket / "volunteers").glob("*.json")]
    if heartbeats != [vid]:
        wrong.append(f"heartbeats {heartbeats}: a ghost row in vrl status")
    summaries = re.findall(r"^uploaded (\d+) shards?, (\d+) groups in \d+s \([\d.]+ groups/s\) "
                           r"on v2; (\d+) groups since start$", log, re.M)
    # the first upload is summed up at once, the next ones at most once per STATUS_SECONDS
    if not 1 <= len(summaries) <= 1 + seconds / STATUS_SECONDS \
            or sum(int(s[0]) for s in summaries) > uploaded:
        wrong.append(f"{len(summaries)} summary lines in {seconds:.0f}s for {uploaded} shards")
    if "uploaded rollouts/" in log:  # a line per shard is --log-shards
        wrong.append(f"{log.count('uploaded rollouts/')} lines for {uploaded} shards")
    assert not wrong, wrong
