"""The task interface and finding tasks: pure logic (task.base, task.registry, the manifest's
`task`, reading a task's CSV). Workers, plugins installed with pip and live runs are in
test_bounded_rewards, test_plugin_install, test_tasks_loop and test_hostile_rewards."""
from __future__ import annotations

import dataclasses
import json
from importlib import metadata

import pytest

from volunteer_rl.config import TrainerConfig
from volunteer_rl.protocol.manifest import Manifest, ManifestError, TaskRef
from volunteer_rl.task import registry
from volunteer_rl.task.base import (
    Row,
    Task,
    clamp_reward,
    completion_reward,
    completion_text,
    in_process,
)
from volunteer_rl.task.calculator_task import CalculatorTask
from volunteer_rl.task.dataset import DatasetError, load_rows

EOS, SPECIAL = 100, 101


def decode(ids):
    return "".join({EOS: "<eos>", SPECIAL: "<pad>"}.get(t, chr(ord("a") + t % 26)) for t in ids)


class Fussy(Task):
    name = "fussy"
    columns = ("q",)

    def prompt(self, row):
        return row["q"]

    def reward(self, completion, row):
        if completion == "raise":
            raise ZeroDivisionError
        return {"nan": float("nan"), "big": 7, "neg": -2, "str": "1", "true": True}.get(
            completion, 0.5)


# --- vrl's rule around a task's reward ---------------------------------------------------------

def test_only_a_completion_ending_at_its_first_eos_with_no_other_special_is_judged():
    assert completion_text([0, 1, EOS], decode, EOS, {EOS, SPECIAL}) == "ab"
    assert completion_text([0, 1], decode, EOS, {EOS, SPECIAL}) is None  # cut off at the cap
    assert completion_text([0, EOS, 1, EOS], decode, EOS, {EOS, SPECIAL}) is None
    assert completion_text([0, SPECIAL, EOS], decode, EOS, {EOS, SPECIAL}) is None
    assert completion_text(None, decode, EOS, {EOS}) is None  # never raises
    assert completion_text([0, EOS], lambda ids: 1 / 0, EOS, {EOS}) is None


def test_a_tasks_value_is_clamped_and_anything_else_is_zero():
    task, row = Fussy(), Row(0, {"q": "x"})
    got = {c: completion_reward(task, row, [ord(c[0]) - ord("a"), EOS],
                                lambda ids, c=c: c, EOS, {EOS}) for c in
           ("raise", "nan", "big", "neg", "str", "true", "other")}
    assert got == {"raise": 0.0, "nan": 0.0, "big": 1.0, "neg": 0.0, "str": 0.0, "true": 0.0,
                   "other": 0.5}
    items = [(c, row) for c in got]
    assert in_process(task)(items) == list(got.values())  # the intake's unit-test stand-in agrees
    assert clamp_reward(float("inf")) is None and clamp_reward(0.25) == 0.25


def test_the_calculator_is_a_task_like_any_other():
    task = CalculatorTask()
    row = Row(3, {"python_expression": "(1 + 2) * 3", "natural_language": "add 1 and 2, times 3"})
    assert task.prompt(row) == "add 1 and 2, times 3" and task.reference(row) == "(1 + 2) * 3"
    assert task.reward("3*(2+1)", row) == 1.0 and task.reward("9 # x", row) == 0.0
    assert task.correct("9", row) and not task.correct("8", row)
    assert task.stratum(row) == 2 and "{question}" in task.instruction
    assert task.check(Row(0, {"python_expression": "1 +", "natural_language": "q"}))
    assert all(p.exists() for p in task.data())


# --- settings: the task's suggestions fill what is left unset ----------------------------------

def test_unset_sampling_settings_are_the_tasks_and_given_ones_win():
    cfg = TrainerConfig(bucket="b")
    assert (cfg.k, cfg.max_new_tokens) == (None, None)
    got = cfg.with_task_defaults(CalculatorTask())
    assert (got.k, got.max_new_tokens) == (8, 32)
    got = TrainerConfig(bucket="b", k=3).with_task_defaults(CalculatorTask())
    assert (got.k, got.max_new_tokens) == (3, 32)


# --- finding tasks ------------------------------------------------------------------------------

def test_the_built_in_tasks_are_installed():
    found = registry.installed()
    assert {"calculator", "countdown"} <= set(found)
    assert found["calculator"].package == "volunteer-rl"
    task, info = registry.load("calculator")
    assert isinstance(task, CalculatorTask) and info.version == metadata.version("volunteer-rl")


def test_an_unknown_task_is_one_line_naming_the_installed_ones():
    with pytest.raises(registry.TaskError) as e:
        registry.info("nope")
    assert "'nope' is not installed" in str(e.value) and "calculator" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value,says", [
    ("no.such.module:X", "No module named"),
    ("collections:OrderedDict", "is not a volunteer_rl.task.base.Task"),
    ("volunteer_rl.task.calculator_task:Missing", "has no attribute"),
])
def test_a_broken_entry_point_is_one_line(value, says):
    with pytest.raises(registry.TaskError) as e:
        registry.load_object(value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_another_package_cannot_take_a_built_in_name(monkeypatch):
    class EP:  # what importlib.metadata gives for an installed entry point
        def __init__(self, name, value):
            self.name, self.value, self.dist = name, value, None
    eps = [EP("calculator", "evil:Task"), EP("bad name!", "x:Y"), EP("mine", "pkg:Mine")]
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: eps)
    found = registry.installed()
    assert found["calculator"].value == registry.BUILT_IN["calculator"][0]
    assert "bad name!" not in found and found["mine"].value == "pkg:Mine"


def test_a_manifests_task_must_be_installed_from_its_package_at_its_version():
    own = registry.installed()["calculator"]
    task, _ = registry.for_manifest(TaskRef("calculator", "Volunteer_RL", own.version))
    assert task.name == "calculator"  # distribution names compare as pip does
    with pytest.raises(registry.TaskError) as e:
        registry.for_manifest(TaskRef("sorting", "vrl-task-sorting", "2.0"))
    guide = "(to install a task you trust: docs/TASKS.md, Installing a task a manifest names)"
    assert str(e.value) == ("manifest.json: task 'sorting' is not installed here; the manifest "
                            f"names package 'vrl-task-sorting' version '2.0' {guide}")
    with pytest.raises(registry.TaskError) as e:
        registry.for_manifest(TaskRef("calculator", "volunteer-rl", "9.9"))
    assert str(e.value) == (f"manifest.json: task 'calculator' is installed from volunteer-rl "
                            f"{own.version}; the manifest names package 'volunteer-rl' version "
                            f"'9.9' {guide}")
    with pytest.raises(registry.TaskError) as e:  # a ref not read through manifest._task
        registry.for_manifest(TaskRef("x\x1b]0;t\x07", "p\x1b[2J", "1\n"))
    assert "\x1b" not in str(e.value) and "\n" not in str(e.value)
    assert "'p\\x1b[2J' version '1\\x0a'" in str(e.value)
    with pytest.raises(registry.TaskError):
        registry.for_manifest(TaskRef("calculator", "someone-else", own.version))


# --- the manifest's task object -----------------------------------------------------------------

def manifest_json(task) -> bytes:
    from volunteer_rl.protocol.manifest import Dataset, Sampling

    m = Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id="r", version=0, checkpoint="checkpoints/v000000", files={},
                 dataset=Dataset("train", "datasets/x.csv", "0" * 64, 10, 5),
                 sampling=Sampling(), max_staleness=1)
    raw = json.loads(m.to_json())
    raw["task"] = task
    return json.dumps(raw).encode()


def test_the_manifest_names_the_task_its_package_and_version():
    ref = {"name": "countdown", "package": "volunteer-rl", "version": "0.1.0"}
    assert Manifest.from_json(manifest_json(ref)).task == TaskRef(**ref)


@pytest.mark.parametrize("task", [
    "calculator",  # schema 7's bare name
    {"name": "x", "package": "p"},
    {"name": "x", "package": "p", "version": "1", "extra": 1},
    {"name": "a b", "package": "p", "version": "1"},
    {"name": "x", "package": "p\x1b[2J", "version": "1"},
    {"name": "x", "package": "p", "version": "1; rm -rf /"},
    {"name": "x" * 41, "package": "p", "version": "1"},
    {"name": 7, "package": "p", "version": "1"},
])
def test_a_task_object_out_of_shape_is_a_one_line_manifest_error(task):
    with pytest.raises(ManifestError) as e:
        Manifest.from_json(manifest_json(task))
    assert "manifest.json: malformed" in str(e.value) and "\n" not in str(e.value)


# --- a task's dataset -----------------------------------------------------------------------------

def test_rows_carry_the_tasks_columns_and_a_bad_row_is_one_line(tmp_path):
    good = tmp_path / "good.csv"
    good.write_text("extra,q\n1, what \n2,why\n")
    assert load_rows(good, Fussy()) == [Row(0, {"q": "what"}), Row(1, {"q": "why"})]
    missing = tmp_path / "missing.csv"
    missing.write_text("a,b\n1,2\n")
    with pytest.raises(DatasetError, match="missing column 'q' for task 'fussy'"):
        load_rows(missing, Fussy())

    class Picky(Fussy):
        def check(self, row):
            return None if row["q"] != "why" else "no whys\nplease"
    with pytest.raises(DatasetError) as e:
        load_rows(good, Picky())
    assert str(e.value) == f"{good}: row 1 (line 3): no whys please"

    class Broken(Fussy):
        def check(self, row):
            raise KeyError("boom")
    with pytest.raises(DatasetError, match="cannot check it"):
        load_rows(good, Broken())
    with pytest.raises(DatasetError, match="file not found"):
        load_rows(tmp_path / "none.csv", Fussy())


def test_a_dataclass_task_ref_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TaskRef("calculator", "volunteer-rl", "0.1.0").name = "x"
