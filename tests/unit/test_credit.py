"""Credit (protocol.credit): summed from the ledger's `trained` records only, one object per
version that a resumed trainer carries on from, bounded in rows and bytes, read as hostile;
and its leaderboard in `vrl status`, on the dashboard and as `vrl volunteers credit` CSV
(observe.leaderboard)."""
from __future__ import annotations

import csv
import io
import json
import time
from types import SimpleNamespace

import pytest
from helpers.status_fixtures import NOW, beat, manifest
from rich.console import Console

from volunteer_rl.observe.dashboard import index_html
from volunteer_rl.observe.leaderboard import COLUMNS, OTHERS, credit_csv, leaderboard, read_leaderboard
from volunteer_rl.observe.status import build_status, read_status, render
from volunteer_rl.protocol import credit as credit_mod
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.credit import (
    MAX_CREDIT_BYTES,
    Credit,
    CreditError,
    parse_credit,
    read_credit,
    write_credit,
)
from volunteer_rl.protocol.ledger import Ledger
from volunteer_rl.storage import open_storage
from volunteer_rl.storage.base import StorageError
from volunteer_rl.trainer.groups import ScoredGroup
from volunteer_rl.trainer.records import record_groups
from volunteer_rl.trainer.startup import restore_credit


def trained(vid: str, lines: list[int], tokens: int | None = None, at: float | None = None,
            version: int = 3, outcome: str = "trained") -> dict:
    rec = {"key": layout.shard_key(version, vid, "s"), "outcome": outcome, "lines": lines,
           "groups": 8}
    if tokens is not None:
        rec["tokens"] = tokens
    if at is not None:
        rec["time"] = at
    return rec


def test_only_trained_groups_count_with_their_tokens_and_times():
    records = [trained("a", [0, 1], 30, 100.0), trained("a", [2], 5, 90.0),
               trained("b", [0, 1, 2], 12, 110.0),
               trained("c", [0, 1], outcome="zero_variance"), trained("c", [3], outcome="stale"),
               trained("c", [4], outcome="duplicate"),
               {"key": layout.shard_key(3, "c", "t"), "outcome": "rejected", "lines": [],
                "groups": 0, "reason": "bad_json"}]
    before = Credit()
    c = before.fold(records, 4, NOW)
    assert before.volunteers == {} and before.version == -1  # fold makes a new one
    assert c.version == 4 and set(c.volunteers) == {"a", "b"}  # c earned nothing
    a, b = c.volunteers["a"], c.volunteers["b"]
    assert (a.groups, a.tokens, a.first_seen, a.last_seen) == (3, 35, 90.0, 100.0)
    assert (b.groups, b.tokens) == (3, 12)
    assert (c.total_groups, c.total_tokens) == (6, 47) and c.share("a") == 0.5
    later = c.fold([trained("a", [5], 7, 200.0)], 5, NOW)
    assert later.volunteers["a"].groups == 4 and later.volunteers["a"].last_seen == 200.0
    assert c.volunteers["a"].groups == 3  # the earlier version's object is left as it was


def test_records_from_before_tokens_and_time_count_no_tokens_at_the_versions_time():
    c = Credit().fold([trained("old", [0, 1])], 1, NOW)
    row = c.volunteers["old"]
    assert (row.groups, row.tokens, row.first_seen, row.last_seen) == (2, 0, NOW, NOW)


def test_trained_ledger_records_carry_tokens_and_time_and_others_do_not():
    led = Ledger()
    g = dict(prompt_id=1, policy_version=3, volunteer_id="a", behavior_logprobs=[], rewards=[],
             key=layout.shard_key(3, "a", "s"), shard_size=4)
    groups = [ScoredGroup(token_ids=[[1, 2, 3], [4]], line=0, **g),
              ScoredGroup(token_ids=[[5], [6, 7]], line=2, **g)]
    record_groups(led, groups, "trained", 7)
    record_groups(led, groups, "stale")
    t, s = led.pending
    assert t["tokens"] == 7 and abs(t["time"] - time.time()) < 60 and t["step"] == 7
    assert "tokens" not in s and "time" not in s
    assert Credit().fold(led.pending, 4, NOW).volunteers["a"].tokens == 7


def test_ids_past_max_rows_are_counted_as_others_and_totals_stay_exact(monkeypatch):
    monkeypatch.setattr(credit_mod, "MAX_ROWS", 2)
    c = Credit().fold([trained(f"v{i}", [0, 1], 10) for i in range(5)], 1, NOW)
    assert set(c.volunteers) == {"v0", "v1"}
    assert (c.others.groups, c.others.tokens) == (6, 30) and c.total_groups == 10
    c = c.fold([trained("v0", [2], 1), trained("v9", [0], 1)], 2, NOW)
    assert c.volunteers["v0"].groups == 3 and c.others.groups == 7  # named ids keep counting
    again = parse_credit(c.encode())
    assert again == c
    rows = list(csv.DictReader(io.StringIO(credit_csv(c))))
    assert rows[-1]["volunteer"] == OTHERS and sum(int(r["groups_trained"]) for r in rows) == 12 == c.total_groups
    monkeypatch.setattr(credit_mod, "MAX_ROWS", 1)
    with pytest.raises(CreditError, match="at most 1 ids"):
        parse_credit(c.encode())


def good() -> dict:
    return json.loads(Credit().fold([trained("a", [0], 3, 5.0)], 2, NOW).encode())


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(schema_version=2), "schema-1"),
    (lambda d: d["volunteers"].update({"../x": d["volunteers"]["a"]}), "not a volunteer id"),
    (lambda d: d["volunteers"].update({"\x1b]52;c;x\x07": d["volunteers"]["a"]}), "not a volunteer id"),
    (lambda d: d["volunteers"]["a"].update(groups=-1), "not a count"),
    (lambda d: d["volunteers"]["a"].update(groups=True), "not a count"),
    (lambda d: d["volunteers"]["a"].update(tokens=1.5), "not a count"),
    (lambda d: d["volunteers"]["a"].update(first_seen="yesterday"), "not a time"),
    (lambda d: d["volunteers"].update(a=[]), "not an object"),
    (lambda d: d.update(total_groups=99), "totals"),
    (lambda d: d.update(volunteers=[]), "volunteers must map"),
    (lambda d: d.update(version=-3), "not a count"),
])
def test_a_credit_object_not_as_the_trainer_writes_it_is_refused_in_one_line(edit, match):
    d = good()
    parse_credit(json.dumps(d).encode())  # as written: fine
    edit(d)
    with pytest.raises(CreditError, match=match) as e:
        parse_credit(json.dumps(d).encode())
    assert "\n" not in str(e.value)


def test_deep_big_and_misnumbered_objects_are_refused():
    with pytest.raises(CreditError, match="nested deeper"):
        parse_credit(b"[" * 100_000)
    s = open_storage("memory://credit-bounds")
    s.write(layout.credit_key(3), b" " * (MAX_CREDIT_BYTES + 1))
    with pytest.raises(StorageError):
        read_credit(s, 3)
    s.write(layout.credit_key(4), Credit(version=5).encode())
    with pytest.raises(CreditError, match="v5's"):
        read_credit(s, 4)
    assert read_credit(s, 6) is None


def publisher(s) -> SimpleNamespace:
    logged = []
    return SimpleNamespace(storage=s, log=logged.append, credit=None, logged=logged)


def test_a_resumed_trainer_carries_on_from_the_resumed_versions_object_never_a_newer_one():
    s = open_storage("memory://credit-resume")
    c4 = Credit().fold([trained("a", [0, 1], 9, 1.0)], 4, NOW)
    write_credit(s, c4)
    # a crash after v5's ledger and credit objects, before its manifest: debris
    write_credit(s, c4.fold([trained("a", [2], 3, 2.0)], 5, NOW))
    p = publisher(s)
    restore_credit(p, 4)
    assert p.credit == c4 and p.logged == []
    with pytest.raises(Exception):  # written once: a version's object is never replaced
        write_credit(s, c4)


def test_without_an_object_credit_is_summed_from_the_committed_ledgers_only():
    s = open_storage("memory://credit-rebuild")
    for v, vid in ((1, "a"), (2, "b"), (3, "a"), (4, "z")):
        led = Ledger()
        led.pending = [trained(vid, [0, 1], 10, float(v), version=v - 1)]
        led.flush(s, v)
    for v in (0, 1, 3):  # v2's manifest copy is missing: a crash before it; v4 is above
        s.write(layout.manifest_history_key(v), b"{}")
    s.write(layout.credit_key(3), b"not json")  # unreadable: summed again as well
    p = publisher(s)
    restore_credit(p, 3)
    assert p.credit.version == 3 and set(p.credit.volunteers) == {"a"}
    assert (p.credit.volunteers["a"].groups, p.credit.volunteers["a"].tokens) == (4, 20)
    assert "credit summed from the ledgers of 3 committed versions" in p.logged[0]


def sample_credit() -> Credit:
    return Credit().fold([trained("small", [0], 4, NOW - 50), trained("big", [0, 1, 2], 30, NOW - 500),
                          trained("big", [3], 10, NOW - 20), trained("tie", [0], 9, NOW - 10)], 42, NOW)


def test_csv_has_every_row_ranked_by_groups_with_share_and_utc_times():
    text = credit_csv(sample_credit())
    rows = list(csv.reader(io.StringIO(text)))
    assert tuple(rows[0]) == COLUMNS
    assert [r[0] for r in rows[1:]] == ["big", "tie", "small"]  # groups, then tokens
    assert rows[1][1:4] == ["4", "40", "0.666667"]
    assert rows[1][4].endswith("Z") and rows[1][4] < rows[1][5]


def test_status_and_the_dashboard_show_the_leaderboard():
    doc = build_status("/b", manifest(), {"big": beat()}, {}, [], [], NOW,
                       leaderboard(sample_credit(), 42))
    assert [r["volunteer"] for r in doc["credit"]["leaders"]] == ["big", "tie", "small"]
    assert doc["credit"]["total_groups"] == 6
    console = Console(width=120, record=True)
    console.print(render(doc))
    out = console.export_text()
    assert "credit as of v42: 6 groups (53 tokens) trained from 3 volunteers" in out
    assert "66.7%" in out
    page = index_html(doc, NOW)
    assert "<h2>credit</h2>" in page and "<td>big</td><td>4</td><td>40</td><td>66.7%</td>" in page
    # a run from before credit objects: said so, no table
    old = build_status("/b", manifest(), {}, {}, [], [], NOW)
    assert old["credit"]["available"] is False and old["credit"]["leaders"] == []


def test_status_reads_the_manifests_versions_object_and_survives_a_broken_one():
    s = open_storage("memory://credit-status")
    s.write(layout.MANIFEST, manifest(42).to_json())
    write_credit(s, Credit().fold([trained("a", [0], 3, NOW)], 41, NOW))
    write_credit(s, Credit().fold([trained("b", [0], 3, NOW)], 43, NOW))  # not committed
    doc = read_status(s, now=NOW)
    assert doc["credit"]["available"] is False and doc["credit"]["version"] == 42
    write_credit(s, sample_credit())
    assert read_status(s, now=NOW)["credit"]["leaders"][0]["volunteer"] == "big"
    s.write(layout.credit_key(42), b'{"schema_version": 1, "volunteers": {"\\u001b[2J": {}}}')
    broken = read_leaderboard(s, 42)
    assert broken["error"] and "\x1b" not in broken["error"] and broken["leaders"] == []
    console = Console(width=120, record=True)
    console.print(render(read_status(s, now=NOW)))
    assert "credit of v42: unreadable" in console.export_text()
