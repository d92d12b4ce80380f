"""The loop for tasks other than the calculator (whose own live loop is test_loop_local): one
`vrl trainer --task NAME` and one `vrl volunteer` process on a folder bucket, for the built-in
countdown and for the example plugin examples/vrl-task-sort, installed with pip into a folder
of its own and put on both processes' PYTHONPATH. A volunteer without the plugin refuses the
run in one line naming the package the manifest names (never as a command to run).

The countdown run (about a minute) is marked slow: the sort plugin's run takes the same path
in the suite, and countdown's rules have unit tests of their own (test_countdown).

Each run warm-starts the tiny model briefly on the task's reference answers, takes a few steps
on the volunteer's groups (rewards recomputed by the trainer) and publishes them; the tests
read what it left.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import plugins
from helpers.bucket_objects import published_versions
from helpers.plugins import plugin_env
from helpers.vrlproc import Proc, one_line_error, run_vrl, stop_on_version
from volunteer_rl.config import PACKAGE_DATA
from volunteer_rl.protocol import layout

sort_plugin = plugins.sort_plugin  # the session fixture: examples/vrl-task-sort installed
STEPS = 3
PACKAGE = {"countdown": ("volunteer-rl", "0.1.0"), "sort": ("vrl-task-sort", "0.1.0")}


def live_run(root: Path, task: str, warm_start: int, held_out: Path,
             env: dict | None = None) -> dict:
    """The run; its evaluations on the first 30 rows of `held_out` (the task's own held-out
    CSV), so that they take a moment."""
    bucket = root / "bucket"
    bucket.mkdir()
    eval_csv = root / "eval30.csv"
    eval_csv.write_text("".join(held_out.read_text().splitlines(True)[:31]))
    trainer = Proc(["trainer", "--bucket", str(bucket), "--task", task,
                    "--warm-start-steps", str(warm_start), "--max-steps", str(STEPS),
                    "--groups-per-step", "8", "--eval-every", "0", "--eval-dataset", str(eval_csv),
                    "--threads", "1", "--poll-seconds", "0.1", "--log-shards",
                    "--work-dir", str(root / "tw")],
                   root / "trainer.log", root, env)
    vol = Proc(["volunteer", "--bucket", str(bucket), "--id", "vol-1", "--threads", "1",
                "--shard-groups", "8", "--shard-seconds", "2", "--prompts-per-batch", "8",
                "--log-shards", "--work-dir", str(root / "vw")], root / "vol.log", root, env)
    try:
        assert trainer.wait(900) == 0, trainer.text()[-3000:]
        final = published_versions(bucket)[-1]
        codes = stop_on_version([vol], final, 120)
    finally:
        trainer.kill()
        vol.kill()
    steps = [json.loads(line) for f in sorted((bucket / "metrics").glob("v*.jsonl"))
             for line in f.read_text().splitlines()]
    return {"root": root, "bucket": bucket, "trainer": trainer.text(), "vol": vol.text(),
            "codes": codes, "metrics": steps}


@pytest.fixture(scope="module")
def countdown(tmp_path_factory):
    return live_run(tmp_path_factory.mktemp("countdown"), "countdown", 200,
                    PACKAGE_DATA / "countdown-eval.csv")


@pytest.fixture(scope="module")
def sort(tmp_path_factory, sort_plugin):
    return live_run(tmp_path_factory.mktemp("sort"), "sort", 100,
                    sort_plugin / "vrl_task_sort" / "data" / "eval.csv", plugin_env(sort_plugin))


@pytest.mark.parametrize("name", [pytest.param("countdown", marks=pytest.mark.slow), "sort"])
def test_a_task_trains_end_to_end(name, request):
    run = request.getfixturevalue(name)
    manifest = json.loads((run["bucket"] / layout.MANIFEST).read_text())
    package, version = PACKAGE[name]
    assert manifest["task"] == {"name": name, "package": package, "version": version}
    assert published_versions(run["bucket"]) == list(range(STEPS + 1))
    steps = [m for m in run["metrics"] if m["kind"] == "step"]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:  # every step trained on the volunteer's groups, rewards recomputed
        assert set(m["rollout/sources"]) and all(
            layout.parse_shard_key(k)[1] == "vol-1" for k in m["rollout/sources"])
        assert 0 < m["rollout/reward_mean"] < 1
    assert re.search(r"took \S+: \d+ usable", run["trainer"])
    assert "rejected" not in run["trainer"] and "Traceback" not in run["trainer"]
    evals = [m for m in run["metrics"] if m["kind"] == "eval"]
    assert evals and all(0 <= m["eval/accuracy_greedy"] <= 1 for m in evals)
    assert f"now on v{STEPS} " in run["vol"] and run["codes"] == [0]


def test_the_held_out_eval_reads_the_task_from_the_manifest(sort, sort_plugin):
    r = run_vrl(["eval", "--bucket", str(sort["bucket"]), "--version", "0", "--samples", "1",
                 "--work-dir", str(sort["root"] / "ew")], cwd=sort["root"], timeout=600,
                env=plugin_env(sort_plugin))
    assert r.returncode == 0, r.stderr
    assert "on 200 sort prompts" in r.stdout  # the plugin's own held-out CSV
    assert re.search(r"v0: greedy \d+\.\d%, sampled \(T=1.0\) \d+\.\d% on 200 prompts", r.stdout)


def test_a_volunteer_without_the_task_refuses_in_one_line(sort):
    r = run_vrl(["volunteer", "--bucket", str(sort["bucket"]), "--id", "bare",
                 "--work-dir", str(sort["root"] / "bare")], cwd=sort["root"], timeout=300)
    assert one_line_error(r) == ("error: manifest.json: task 'sort' is not installed here; the "
                                 "manifest names package 'vrl-task-sort' version '0.1.0' (to "
                                 "install a task you trust: docs/TASKS.md, Installing a task a "
                                 "manifest names)")
    assert not list((sort["bucket"] / "rollouts").glob("*/bare/*"))  # it sampled nothing


def test_a_trainer_of_a_task_not_installed_is_one_line(tmp_path):
    r = run_vrl(["trainer", "--bucket", str(tmp_path / "b"), "--task", "sort",
                 "--work-dir", str(tmp_path / "w")], cwd=tmp_path)
    assert one_line_error(r).startswith("error: task 'sort' is not installed (installed: "
                                        "calculator, countdown)")
    assert not (tmp_path / "b").exists()  # nothing written, not even the folder


def test_vrl_tasks_lists_the_installed_ones(sort_plugin, tmp_path):
    bare = run_vrl(["tasks"], cwd=tmp_path)
    assert bare.returncode == 0, bare.stderr
    names = [line.split()[0] for line in bare.stdout.splitlines() if line and not line[0].isspace()]
    assert names == ["calculator", "countdown"]
    r = run_vrl(["tasks", "--verbose"], cwd=tmp_path, env=plugin_env(sort_plugin))
    assert r.returncode == 0, r.stderr
    assert re.search(r"^sort\s+vrl-task-sort 0\.1\.0\s+\(vrl_task_sort", r.stdout, re.M), r.stdout
    assert "columns numbers" in r.stdout


def test_a_refused_task_is_named_as_the_manifests_words_never_as_a_command(tmp_path):
    """A manifest signed by a key the volunteer only pins on first use names a package of its
    choosing: the refusal quotes it as what the manifest says and points to docs/TASKS.md;
    it prints no install command built from the bucket's text."""
    from volunteer_rl.protocol.manifest import Dataset, FileEntry, Manifest, Sampling, TaskRef
    from volunteer_rl.protocol.signing import Ed25519PrivateKey

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    m = Manifest(task=TaskRef("evil", "evil-tasks", "1.0"), run_id="run-x", version=0,
                 checkpoint=layout.checkpoint_prefix(0),
                 files={"config.json": FileEntry("ab" * 32, 1000)},
                 dataset=Dataset("train", "datasets/train-abc.csv", "cd" * 32, 10, 1),
                 sampling=Sampling(8, 1.0, 32), max_staleness=2, created_at=1_795_306_223.2)
    (bucket / layout.MANIFEST).write_bytes(m.to_signed_json(Ed25519PrivateKey.generate()))
    r = run_vrl(["volunteer", "--bucket", str(bucket), "--id", "v", "--work-dir",
                 str(tmp_path / "w")], cwd=tmp_path, timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "pip install" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert ("error: manifest.json: task 'evil' is not installed here; the manifest names "
            "package 'evil-tasks' version '1.0' (to install a task you trust: docs/TASKS.md, "
            "Installing a task a manifest names)") in r.stderr.splitlines(), r.stderr
    assert not (bucket / "rollouts").exists()  # it sampled nothing
