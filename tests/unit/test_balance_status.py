"""The fleet's useful fraction and each volunteer's, and the quota, as `vrl status` (table and
--json) and the dashboard show them from fleet.json (schema 5), and a volunteer's `waiting`
from its heartbeat; an older fleet.json or hostile values read as unknown, never an error."""
from __future__ import annotations

import json

from rich.console import Console
from typer.testing import CliRunner

from helpers.status_fixtures import NOW, beat, manifest
from volunteer_rl.observe.dashboard import index_html
from volunteer_rl.observe.status import build_status, render
from volunteer_rl.protocol import layout
from volunteer_rl.storage import open_storage
from volunteer_rl_cli.main import app

BALANCE = {"window_seconds": 60.0, "groups_received": 1990, "groups_trained": 1234,
           "useful_fraction": 0.62, "usable_fraction": 0.7, "volunteers": 2.0,
           "quota": {"groups": 40, "wait_seconds": 2.5}}
SUMMARY = {"schema_version": 5, "balance": BALANCE,
           "volunteers": {"a": {"accepted_shards": 9, "groups_trained": 50,
                                "groups_received_recent": 1000, "groups_trained_recent": 700,
                                "useful_fraction": 0.7},
                          "b": {"accepted_shards": 9, "groups_trained": 50,
                                "groups_received_recent": 990, "groups_trained_recent": 534,
                                "useful_fraction": 0.5394}}}
WAITING = beat(completions_per_minute=0, waiting="quota of v40 reached (40 groups)")


def text_of(doc, width=160) -> str:
    console = Console(record=True, width=width)
    console.print(render(doc))
    return console.export_text()


def test_status_shows_the_fleets_and_each_volunteers_useful_fraction_and_the_quota():
    doc = build_status("/b", manifest(), {"a": beat(), "b": WAITING}, SUMMARY, [], [], NOW)
    assert doc["balance"] == BALANCE
    a, b = doc["volunteers"]
    assert (a["useful_fraction"], a["groups_received_recent"], a["groups_trained_recent"]) == (0.7, 1000, 700)
    assert a["waiting"] is None and b["waiting"] == "quota of v40 reached (40 groups)"
    assert b["state"] == "idle"
    text = text_of(doc)
    assert ("useful: 62% of 1,990 groups received in the last 60s trained (70% usable); quota 40 "
            "groups per volunteer per version, 2.5s wait") in text
    assert "idle (waiting)" in text
    header = next(line for line in text.splitlines() if line.startswith("volunteer "))
    assert "useful" in header
    row_b = next(line for line in text.splitlines() if line.startswith("b "))
    assert " 54% " in row_b
    json.dumps(doc)


def test_an_older_fleet_json_or_hostile_values_read_as_unknown():
    old = {"schema_version": 4, "volunteers": {"a": {"accepted_shards": 3}}}
    doc = build_status("/b", manifest(), {"a": beat()}, old, [], [], NOW)
    assert doc["balance"]["useful_fraction"] is None and doc["balance"]["quota"] is None
    (row,) = doc["volunteers"]
    assert (row["useful_fraction"], row["groups_received_recent"], row["waiting"]) == (None, 0, None)
    assert "useful: no groups received lately; no quota" in text_of(doc)
    hostile = {"balance": {"useful_fraction": 5, "usable_fraction": "x", "groups_received": float("nan"),
                           "quota": {"groups": "many", "wait_seconds": 1}},
               "volunteers": {"a": {"useful_fraction": -1, "groups_received_recent": -7}}}
    doc = build_status("/b", manifest(), {"a": beat(waiting=["not", "text"])}, hostile, [], [], NOW)
    assert doc["balance"]["useful_fraction"] is None and doc["balance"]["usable_fraction"] is None
    assert doc["balance"]["groups_received"] is None and doc["balance"]["quota"] is None
    (row,) = doc["volunteers"]
    assert (row["useful_fraction"], row["groups_received_recent"], row["waiting"]) == (None, 0, None)
    text_of(doc)
    weird = build_status("/b", manifest(), {"a": beat(waiting="\x1b[31m" + "w" * 500)}, {}, [], [], NOW)
    assert "\x1b" not in weird["volunteers"][0]["waiting"] and len(weird["volunteers"][0]["waiting"]) < 200


def test_the_dashboard_page_shows_the_balance_and_each_volunteers_useful_fraction():
    doc = build_status("/b", manifest(), {"a": beat(), "b": WAITING}, SUMMARY, [], [], NOW)
    page = index_html(doc, NOW)
    assert ("useful: 62% of 1,990 groups received in the last 60s trained (70% usable); quota 40 "
            "groups per volunteer per version, 2.5s wait.") in page
    assert "<th>useful (last min)</th>" in page and "<td>70%</td>" in page and "<td>54%</td>" in page


def test_vrl_status_json_and_table_carry_the_balance(tmp_path):
    s = open_storage(str(tmp_path))
    s.write(layout.MANIFEST, manifest().to_json())
    s.write(layout.FLEET, json.dumps(SUMMARY).encode())
    s.write(layout.heartbeat_key("b"), json.dumps(WAITING).encode())
    r = CliRunner().invoke(app, ["status", "--bucket", str(tmp_path), "--json"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["balance"]["useful_fraction"] == 0.62 and doc["balance"]["quota"]["groups"] == 40
    assert {v["id"]: v["useful_fraction"] for v in doc["volunteers"]} == {"a": 0.7, "b": 0.5394}
    r = CliRunner().invoke(app, ["status", "--bucket", str(tmp_path)], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and "useful: 62% of 1,990 groups" in r.stdout
