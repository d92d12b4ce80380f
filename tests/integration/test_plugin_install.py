"""A task is an installed package: examples/vrl-task-sort, installed with real pip into a
folder of its own, is found through its entry point by a process that has that folder on its
PYTHONPATH (as a volunteer or trainer would have it in its venv), with the name and version of
its distribution; its shipped data is right by its own reward. Without it, asking for "sort"
is one line naming the tasks that are installed."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import plugins
from volunteer_rl.task import registry

sort_plugin = plugins.sort_plugin

PROBE = r"""
import csv, json, sys, tempfile, time
from pathlib import Path
from volunteer_rl.task import registry
from volunteer_rl.task.base import Row

found = registry.installed()
task, info = registry.load("sort")
train, held_out = task.data()
scores, refusals = [], []
for path in (train, held_out):
    with open(path, newline="") as f:
        for i, r in enumerate(csv.DictReader(f)):
            row = Row(i, {c: r[c].strip() for c in task.columns})
            refusals.append(task.check(row))
            scores.append(task.reward(task.reference(row), row))
            scores.append(task.reward(" " + row["sorted"] + "\n", row))
row = Row(0, {"numbers": "42 7 19", "sorted": "7 19 42"})
wrong = ["42 7 19", "7 19", "7 42 19", "7  19 42", "", "<eos>7 19 42", "7 19 42 <eos>",
         "__import__('os').system('true')", "9" * 10**6, "\x00\ud800 7 19 42"]
start = time.process_time()
wrong_scores = [task.reward(w, row) for w in wrong]
wrong_seconds = time.process_time() - start
bad_rows = {"unsorted": {"numbers": "3 1 2", "sorted": "3 1 2"},
            "missing": {"numbers": "3 1 2", "sorted": "1 2"},
            "words": {"numbers": "three one", "sorted": "one three"},
            "too many": {"numbers": " ".join(["1"] * 21), "sorted": " ".join(["1"] * 21)},
            "one number": {"numbers": "5", "sorted": "5"},
            "empty": {"numbers": "", "sorted": ""}}
try:  # the trainer's way: in a worker process, under the bounds the task declares
    from volunteer_rl.task.bounded import BoundedRewards
    with BoundedRewards(info.value, task.reward_seconds, task.reward_memory_mb) as b:
        bounded = b.rewards([(w, row) for w in ["7 19 42", *wrong]]) == [1.0] + wrong_scores
except Exception as exc:
    bounded = f"{type(exc).__name__}: {exc}"
with tempfile.TemporaryDirectory() as d:
    from vrl_task_sort import make_data
    make_data.main(Path(d))
    same = [(Path(d) / p.name).read_bytes() == p.read_bytes() for p in (train, held_out)]
print(json.dumps({
    "info": [info.name, info.value, info.package, info.version],
    "names": sorted(found), "task_name": task.name, "columns": list(task.columns),
    "bounds": [task.reward_seconds, task.reward_memory_mb, task.k, task.max_new_tokens],
    "data": [str(train), str(held_out)], "rows": len(refusals),
    "refusals": [x for x in refusals if x is not None], "scores": sorted(set(scores)),
    "right": task.reward("7 19 42", row), "wrong": wrong_scores, "wrong_seconds": wrong_seconds,
    "bad_rows": {k: task.check(Row(0, v)) for k, v in bad_rows.items()},
    "strata": [task.stratum(Row(0, {"numbers": n, "sorted": ""})) for n in ("1 2", "1 2 3 4 5 6")],
    "regenerated_same": same, "bounded": bounded,
}))
"""


def package_version() -> str:
    text = (plugins.SORT_PACKAGE / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


@pytest.fixture(scope="module")
def probe(sort_plugin: Path) -> dict:
    """PROBE's findings, run in a fresh interpreter with the installed plugin on its path."""
    r = subprocess.run([sys.executable, "-c", PROBE], env=plugins.plugin_env(sort_plugin),
                       cwd=sort_plugin.parent, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_installed_plugin_is_found_with_its_distribution(probe, sort_plugin):
    assert probe["info"] == ["sort", "vrl_task_sort:SortTask", "vrl-task-sort", package_version()]
    assert {"calculator", "countdown", "sort"} <= set(probe["names"])
    assert probe["task_name"] == "sort" and probe["columns"] == ["numbers", "sorted"]
    assert probe["bounds"] == [0.5, 64, 8, 24]
    # data() finds the CSVs the install copied as package data, not the checkout's
    for path in probe["data"]:
        assert Path(path).is_relative_to(sort_plugin) and Path(path).stat().st_size < 100_000


def test_shipped_data_is_right_by_its_own_reward(probe):
    assert probe["rows"] == 2200
    assert probe["refusals"] == []
    assert probe["scores"] == [1.0]  # every reference, and every answer with outer whitespace
    assert probe["regenerated_same"] == [True, True]  # make_data rewrites the same bytes


def test_wrong_and_hostile_answers_score_zero_quickly(probe):
    assert probe["right"] == 1.0
    assert probe["wrong"] == [0.0] * 10
    # a 1 MB text among them; CPU time of the probe's process (time.process_time), which
    # other processes do not stretch: one linear pass takes about a millisecond of it
    assert probe["wrong_seconds"] < 0.1
    assert probe["strata"] == [0, 4]


def test_rewards_agree_under_the_trainers_bounds(probe):
    """task.bounded runs the plugin in a worker (PYTHONPATH passed on) within its own bounds."""
    assert probe["bounded"] is True


def test_check_refuses_bad_rows(probe):
    for what, why in probe["bad_rows"].items():
        assert isinstance(why, str) and why and "\n" not in why, (what, why)


def test_install_leaves_the_example_folder_as_it_was(tmp_path):
    """pip builds a local project inside it (build/, *.egg-info): install_plugin builds a copy."""
    def tree() -> list:
        return sorted((str(p.relative_to(plugins.SORT_PACKAGE)), p.stat().st_mtime_ns)
                      for p in [plugins.SORT_PACKAGE, *plugins.SORT_PACKAGE.rglob("*")])

    before = tree()
    target = plugins.install_plugin(plugins.SORT_PACKAGE, tmp_path)
    assert tree() == before
    assert list((tmp_path / "src").glob("*.egg-info"))  # where the build went
    assert (target / "vrl_task_sort" / "data" / "eval.csv").is_file()


def test_without_the_package_sort_is_not_installed():
    assert "sort" not in registry.installed()
    with pytest.raises(registry.TaskError) as e:
        registry.info("sort")
    message = str(e.value)
    assert "\n" not in message and "'sort' is not installed" in message
    assert "calculator" in message and "countdown" in message


def test_tasks_page_holds_the_package_as_it_is():
    """docs/TASKS.md shows the example's files in full: each, verbatim, as a code block."""
    page = (plugins.ROOT / "docs" / "TASKS.md").read_text()
    for path in ("pyproject.toml", "vrl_task_sort/__init__.py", "vrl_task_sort/make_data.py"):
        text = (plugins.SORT_PACKAGE / path).read_text()
        assert f"`examples/vrl-task-sort/{path}`" in page
        assert f"\n{text}```\n" in page, f"docs/TASKS.md does not show {path} as it is"
