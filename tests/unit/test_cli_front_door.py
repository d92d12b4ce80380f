"""The front door of `vrl` (issue 27): known mistakes on the command line are one line naming
the flag, never a traceback; bucket strings that cannot be what the user meant are refused;
key material is never echoed; every number has a range; `--version`; help grouped in panels
that read at 80 columns; `--config FILE.toml`. And (issue 39) help that reads as help: one
line per command in `vrl --help`, paragraphs that the terminal wraps, no flag shown taking a
value, no source file named, no option that does nothing; and maps of the code that name
every module."""
from __future__ import annotations

import importlib.util
import inspect
import re
from dataclasses import fields
from importlib import metadata
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

import volunteer_rl
from volunteer_rl.config import TrainerConfig, VolunteerConfig, range_text
from volunteer_rl.demo import DemoSettings
from volunteer_rl.model.devices import DeviceError, pick_device
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from volunteer_rl.protocol.signing import private_key_pem
from volunteer_rl.storage.uri import local_folder
from volunteer_rl.storage.base import StorageError
from helpers.cli_stand_ins import stand_ins
from volunteer_rl_cli.main import app
from volunteer_rl_cli.options import PANELS




def vrl(*args: str, columns: int = 250, **env: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns), **env})


def one_line(r) -> str:
    """The single `error:` line of a failed command, with no traceback."""
    assert r.exit_code == 1, (r.exit_code, r.output, r.exception)
    assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.splitlines()
    return line


@pytest.fixture
def built(monkeypatch) -> list:
    """The settings `vrl trainer`, `vrl volunteer` and `vrl demo` hand the library, from
    stand-ins that do nothing (as in test_cli)."""
    return stand_ins(monkeypatch)


# --- 1. known errors are one line naming the flag ---------------------------------------------

def test_a_scheme_whose_package_is_missing_names_the_package_and_the_extra(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gcsfs" else real(name, *a))
    for command in (("status",), ("volunteers", "list"), ("dashboard",)):
        assert one_line(vrl(*command, "--bucket", "gs://b/run")) == (
            "error: --bucket gs://b/run: gs:// needs the package gcsfs, which is not installed: "
            "pip install gcsfs (what vrl's [gcs] extra adds; docs/DEPLOY.md)")


def test_an_endpoint_without_its_scheme_is_one_line():
    for command in (("status",), ("gc",), ("volunteers", "deny", "bob")):
        assert one_line(vrl(*command, "--bucket", "s3://b/run", "--endpoint-url",
                            "127.0.0.1:9")) == (
            "error: --endpoint-url 127.0.0.1:9: give a URL with its scheme, such as "
            "http://127.0.0.1:9")


@pytest.mark.parametrize("name,message", [
    ("tpu", "--device tpu: use auto, cpu, cuda, cuda:N or mps"),
    ("cuda", "--device cuda: this torch "),
    ("cuda:0", "--device cuda:0: this torch "),
    ("mps", "--device mps: this torch or machine has no MPS"),
])
def test_a_device_this_torch_cannot_use_is_refused_before_anything_loads(name, message):
    if name.startswith("cuda") and torch.cuda.is_available() or \
            name == "mps" and torch.backends.mps.is_available():
        pytest.skip(f"{name} is usable here")
    with pytest.raises(DeviceError) as e:
        pick_device(name)
    assert str(e.value).startswith(message)
    assert pick_device("cpu") == torch.device("cpu") and pick_device("auto").type in (
        "cpu", "cuda", "mps")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_eval_and_volunteer_with_an_unusable_device_end_in_one_line(tmp_path):
    bucket, work = tmp_path / "bucket", str(tmp_path / "work")
    bucket.mkdir()
    why = "is a CPU-only build" if torch.version.cuda is None else "sees no CUDA GPU"
    cuda = f"error: --device cuda: this torch {why}; use --device cpu or auto"
    assert one_line(vrl("eval", "--bucket", str(bucket), "--device", "cuda",
                        "--work-dir", work)) == cuda
    # The real Volunteer: it refuses before it says anything (it used to log "on cuda").
    assert one_line(vrl("volunteer", "--bucket", str(bucket), "--device", "cuda", "--id", "v",
                        "--work-dir", work)) == cuda
    assert one_line(vrl("volunteer", "--bucket", str(bucket), "--device", "tpu", "--id", "v",
                        "--work-dir", work)) == \
        "error: --device tpu: use auto, cpu, cuda, cuda:N or mps"


# --- 2. bucket strings that cannot be what was meant -----------------------------------------

@pytest.mark.parametrize("uri", ["s3:/x", "gs:bucket/run", "memory:/name", "file:/tmp/x"])
def test_a_url_missing_its_slashes_is_refused_and_makes_no_folder(built, monkeypatch, tmp_path,
                                                                  uri):
    monkeypatch.chdir(tmp_path)
    scheme = uri.split(":")[0]
    expected = (f"error: --bucket {uri}: looks like a URL missing its '//' (such as "
                f"{scheme}://...); for a folder of that name write ./{uri}")
    for command in (("trainer",), ("volunteer",), ("status",), ("volunteers", "deny", "bob")):
        assert one_line(vrl(*command, "--bucket", uri)) == expected, command
    assert list(tmp_path.iterdir()) == [] and built == []


def test_a_folder_named_like_a_scheme_is_still_a_folder_when_spelled_as_a_path():
    assert local_folder("./s3:x") == Path("./s3:x")
    assert local_folder("C:/runs/one") == Path("C:/runs/one")  # a Windows drive, one letter
    assert local_folder("file:///tmp/b") == Path("/tmp/b") and local_folder("s3://b/r") is None
    with pytest.raises(StorageError, match="^--bucket is empty"):
        local_folder("")


@pytest.mark.parametrize("command", [
    ("volunteer",), ("status",), ("status", "--json"), ("dashboard",), ("gc",),
    ("eval", "--device", "cpu"), ("volunteers", "list"), ("volunteers", "deny", "bob"),
    ("volunteers", "allow", "bob")])
def test_a_folder_bucket_that_does_not_exist_is_an_error_and_is_not_made(built, tmp_path, command):
    missing = tmp_path / "no" / "such" / "folder"
    work = ("--work-dir", str(tmp_path / "w")) if command[0] in ("volunteer", "eval") else ()
    line = one_line(vrl(*command, "--bucket", str(missing), *work))
    assert line == (f"error: --bucket {missing}: no such folder (only the trainer creates a "
                    "folder bucket; check the path)")
    assert not (tmp_path / "no").exists() and built == []


def test_the_trainer_makes_its_folder_bucket_before_its_slow_imports(built, tmp_path):
    bucket = tmp_path / "new" / "bucket"
    r = vrl("trainer", "--bucket", str(bucket))
    assert r.exit_code == 0, r.output
    assert bucket.is_dir() and built == [TrainerConfig(bucket=str(bucket))]
    (tmp_path / "file").write_text("x")
    line = one_line(vrl("trainer", "--bucket", str(tmp_path / "file")))
    assert line.startswith(f"error: --bucket {tmp_path / 'file'}: cannot create the folder")


# --- 3. key material is never echoed ---------------------------------------------------------

@pytest.fixture
def private_pem(tmp_path) -> Path:
    path = tmp_path / "signing-key.pem"
    path.write_bytes(private_key_pem(Ed25519PrivateKey.generate()))
    return path


def secret_lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("-----")]


def test_a_private_key_given_as_trust_key_is_refused_without_quoting_it(built, tmp_path,
                                                                       private_pem):
    path = private_pem
    fix = ("is a private key: give its public half (`vrl public-key`, or the .pub file beside "
           "it) and keep the private one secret")
    (tmp_path / "b").mkdir()
    for given, named in ((str(path), str(path)), (path.read_text(), "--trust-key")):
        for command in (("eval", "--device", "cpu"), ("gc",)):
            line = one_line(vrl(*command, "--bucket", str(tmp_path / "b"), "--trust-key", given))
            assert line == f"error: {named}: {fix}", command
            assert not any(secret[:8] in line for secret in secret_lines(path))


def test_no_key_parsing_message_quotes_what_it_was_given():
    from volunteer_rl.protocol.signing import KeyFileError, parse_public_key

    for text in ("ed25519:Zq9xW!!", "-----BEGIN OPENSSH PRIVATE KEY-----\nZq9xWb3BlbnNzaC1rZXk",
                 "AAAAC3NzaC1lZDI1NTE5AAAAIZq9xW"):
        with pytest.raises(KeyFileError) as e:
            parse_public_key(text, "--trust-key")
        assert "Zq9xW" not in str(e.value)


def test_an_empty_trust_key_is_refused_not_trust_on_first_use(built, tmp_path):
    (tmp_path / "b").mkdir()
    for command in (("volunteer",), ("eval",), ("gc",)):
        r = vrl(*command, "--bucket", str(tmp_path / "b"), "--trust-key", "")
        assert r.exit_code == 2 and "Traceback" not in r.stderr, r.output
        assert "'--trust-key'" in r.stderr and "is empty: give the trainer's public key" in r.stderr
    r = vrl("volunteer", "--bucket", str(tmp_path / "b"), "--trust-key", " ")
    assert r.exit_code == 2 and built == []


# --- 4. every number has a range --------------------------------------------------------------

def numeric_options():
    """(command path, option) for every int or float option of every `vrl` command."""
    def walk(group, path):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                yield from walk(command, (*path, name))
                continue
            for p in command.params:
                if p.param_type_name == "option" and not p.is_flag and \
                        p.type_descriptor.annotation in (int, float):
                    yield " ".join((*path, name)), p
    return list(walk(typer.main.get_command(app), ()))


def test_every_numeric_option_of_every_command_has_a_range():
    options = numeric_options()
    assert len(options) > 40  # the walk reaches every command (the trainer alone has 27)
    unbounded = []
    for command, p in options:
        setting = getattr(p.callback, "setting", None)  # an option made by options.option
        bounded = range_text(*setting) if setting else (p.min is not None or p.max is not None)
        if not bounded:
            unbounded.append(f"vrl {command} {p.opts[0]}")
    assert unbounded == []


def test_settings_shown_as_options_carry_their_rules_in_help():
    out = vrl("trainer", "--help").stdout
    for shown in ("FLOAT [x>0]", "FLOAT [0<x<=1]", "INT [1<=x<=256]", "reinforce|grpo",
                  "FLOAT [0<=x<=1]"):
        assert shown in out, shown


@pytest.mark.parametrize("args,message", [
    (("trainer", "--max-steps", "-5"), "'--max-steps': must be at least 0, not -5"),
    (("trainer", "--eval-every", "-1"), "'--eval-every': must be at least 0, not -1"),
    (("trainer", "--deny-rate", "5"), "'--deny-rate': must be at most 1, not 5.0"),
    (("trainer", "--threads", "-3"), "'--threads': must be at least 0, not -3"),
    (("trainer", "--poll-seconds", "-1"), "'--poll-seconds': must be more than 0, not -1.0"),
    (("trainer", "--warm-start-steps", "-1"), "'--warm-start-steps': must be at least 0, not -1"),
    (("volunteer", "--max-seconds", "-1"), "'--max-seconds': must be at least 0, not -1.0"),
    (("volunteer", "--poll-seconds", "0"), "'--poll-seconds': must be more than 0, not 0.0"),
    (("demo", "--volunteers", "0"), "'--volunteers': must be at least 1, not 0"),
    (("demo", "--rl-seconds", "-5"), "'--rl-seconds': must be more than 0, not -5.0"),
    (("demo", "--warm-start-steps", "-1"), "'--warm-start-steps': must be at least 0, not -1"),
    (("eval", "--samples", "0"), "'--samples': must be at least 1, not 0"),
    (("gc", "--keep-versions", "0"), "'--keep-versions': must be at least 1, not 0"),
])
def test_the_numbers_seen_unbounded_are_refused_before_anything_runs(built, tmp_path, args,
                                                                      message):
    bucket = () if args[0] == "demo" else ("--bucket", str(tmp_path))
    r = vrl(*args, *bucket)
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.stderr, r.output
    assert built == []


def test_a_demo_of_a_task_not_installed_is_one_line_before_anything_runs(built):
    line = one_line(vrl("demo", "--task", "nope"))
    assert line.startswith("error: task 'nope' is not installed (installed: calculator, "
                           "countdown"), line
    assert built == []  # (the trainer's own refusal: test_tasks_loop, a real process)


# --- 5. --version ------------------------------------------------------------------------------

def test_version_is_the_installed_package_version_on_one_line():
    r = vrl("--version")
    assert (r.exit_code, r.stdout) == (0, f"vrl {metadata.version('volunteer-rl')}\n")


# --- 6. help in panels, readable at 80 columns ---------------------------------------------

@pytest.mark.parametrize("command", ["trainer", "volunteer", "demo"])
def test_every_option_sits_in_a_panel_and_help_reads_at_80_columns(command):
    click_command = typer.main.get_command(app).commands[command]
    unpanelled = [p.name for p in click_command.params
                  if p.param_type_name == "option" and p.name != "config"
                  and p.rich_help_panel is None and not p.hidden]
    assert unpanelled == []
    out = vrl(command, "--help", columns=80).stdout
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in out  # nothing cut off
    titles = {p.rich_help_panel for p in click_command.params if p.rich_help_panel}
    for title in titles:
        assert f"╭─ {title} ─" in out, title
    if command == "trainer":
        assert {"Storage", "Model", "Data", "RL", "Publishing", "Audits and denylist"} <= titles
        # ~40 options in panels of at most a dozen
        assert max(sum(p.rich_help_panel == t for p in click_command.params) for t in titles) <= 12


def test_each_setting_has_one_panel():
    names = [n for names in PANELS.values() for n in names]
    assert len(names) == len(set(names))
    settings = {f.name for cls in (TrainerConfig, VolunteerConfig, DemoSettings)
                for f in fields(cls)}
    assert set(names) <= settings


# --- 7. --config FILE.toml -----------------------------------------------------------------

def test_a_config_file_sets_options_by_setting_name_and_the_command_line_wins(built, tmp_path):
    bucket = tmp_path / "b"
    bucket.mkdir()
    (tmp_path / "run.toml").write_text(
        f'bucket = "{bucket}"\nmax_staleness = 4\nlr = 1\ncurriculum = false\nalgo = "reinforce"\n')
    r = vrl("trainer", "--config", str(tmp_path / "run.toml"), "--max-staleness", "1")
    assert r.exit_code == 0, r.output
    (tmp_path / "vol.toml").write_text(f'bucket = "{bucket}"\nvolunteer_id = "laptop"\n'
                                       'max_seconds = 60\nthreads = 1\n')
    r = vrl("volunteer", "--config", str(tmp_path / "vol.toml"), "--threads", "2")
    assert r.exit_code == 0, r.output
    (tmp_path / "demo.toml").write_text('volunteers = 3\nrl_seconds = 60\nlr = 0.001\n')
    r = vrl("demo", "--config", str(tmp_path / "demo.toml"))
    assert r.exit_code == 0, r.output
    assert built == [
        TrainerConfig(bucket=str(bucket), max_staleness=1, lr=1.0, curriculum=False,
                      algo="reinforce"),
        VolunteerConfig(bucket=str(bucket), volunteer_id="laptop", max_seconds=60.0, threads=2),
        DemoSettings(volunteers=3, rl_seconds=60.0, lr=1e-3)]
    assert type(built[0].lr) is float and type(built[1].max_seconds) is float


@pytest.mark.parametrize("command,text,message", [
    ("trainer", "max_stepz = 3",
     "max_stepz: not an option of `vrl trainer` (did you mean max_steps?)"),
    ("trainer", "max-steps = 3",
     "max-steps: not an option of `vrl trainer` (did you mean max_steps?)"),
    ("trainer", "zzz = 1", "zzz: not an option of `vrl trainer`; keys are setting names, such as "
                           "max_staleness"),
    ("trainer", "max_steps = -5", "max_steps: must be at least 0, not -5"),
    ("trainer", "max_steps = 2.5", "max_steps: must be an integer, not 2.5"),
    ("trainer", "lr = '1e-3'", "lr: must be a number, not '1e-3'"),
    ("trainer", "lr = 0", "lr: must be more than 0, not 0.0"),
    ("trainer", "curriculum = 1", "curriculum: must be true or false, not 1"),
    ("trainer", "k = true", "k: must be an integer, not True"),
    ("trainer", "algo = 'ppo'", "algo: use reinforce or grpo, not 'ppo'"),
    ("trainer", "bucket = 3", "bucket: must be a string, not 3"),
    ("volunteer", "nice = 20", "nice: must be at most 19, not 20"),
    ("volunteer", "id = 'x'", "id: not an option of `vrl volunteer` (did you mean volunteer_id?)"),
    ("demo", "volunteers = 0", "volunteers: must be at least 1, not 0"),
    ("demo", "warm_start_steps = -1", "warm_start_steps: must be at least 0, not -1"),
])
def test_a_bad_key_or_value_in_the_file_is_one_line_naming_file_and_key(built, tmp_path, command,
                                                                       text, message):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    bucket = () if command == "demo" else ("--bucket", str(tmp_path))
    assert one_line(vrl(command, "--config", str(path), *bucket)) == f"error: {path}: {message}"
    assert built == []


def test_an_unreadable_or_malformed_file_is_one_line(built, tmp_path):
    missing = tmp_path / "nope.toml"
    assert one_line(vrl("trainer", "--config", str(missing), "--bucket", str(tmp_path))) == \
        f"error: --config {missing}: cannot read it (No such file or directory)"
    bad = tmp_path / "bad.toml"
    bad.write_text("max_steps = \n")
    assert one_line(vrl("volunteer", "--config", str(bad), "--bucket", str(tmp_path))).startswith(
        f"error: {bad}: not valid TOML (")
    assert built == []


def test_every_command_with_options_takes_a_config_file(tmp_path):
    """--config on the observing and operating commands too: a file naming the bucket is
    enough, and a bad key is one line naming the file and the command."""
    bucket = tmp_path / "b"
    bucket.mkdir()
    path = tmp_path / "ops.toml"
    path.write_text(f'bucket = "{bucket}"\n')
    r = vrl("volunteers", "list", "--config", str(path))
    assert (r.exit_code, r.stdout) == (0, "no volunteer is denied\n"), r.output
    r = vrl("volunteers", "deny", "bob", "--config", str(path))
    assert (r.exit_code, r.stdout) == (0, "bob: denied\n"), r.output
    r = vrl("gc", "--config", str(path), "--dry-run")
    assert one_line(r) == (f"error: manifest.json: not found in {bucket}; without it nothing is "
                           "known to be safe to delete")  # it read the bucket the file names
    path.write_text("zzz = 1\n")
    for name, *args in (("eval",), ("status",), ("dashboard",), ("gc",), ("public-key",),
                        ("list", "volunteers", "list"), ("allow", "volunteers", "allow", "bob")):
        assert one_line(vrl(*(args or [name]), "--config", str(path))).startswith(
            f"error: {path}: zzz: not an option of `vrl {name}`"), name


# --- 8. help and maps (issue 39) ----------------------------------------------------------------

def every_command(group=None, path: tuple[str, ...] = ()):
    """(command path, click command) of every `vrl` command, groups included, the app first."""
    group = group or typer.main.get_command(app)
    yield path, group
    for name, command in getattr(group, "commands", {}).items():
        yield from every_command(command, (*path, name))


def docstring(command) -> str:
    """The text a command's help is made from: its function's docstring, or a group's help."""
    return inspect.getdoc(command.callback) if command.callback and command.callback.__doc__ \
        else command.help


@pytest.mark.parametrize("path", [(), ("volunteers",)])
def test_vrl_help_lists_each_command_by_its_summary_on_one_line(path):
    """The summary is the docstring's first line; the rest of the docstring, typer's default
    in the list, made `vrl --help` 40 lines of prose."""
    group = dict(every_command())[path]
    out = vrl(*path, "--help", columns=80).stdout
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("╭─ Commands"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
    rows = lines[start + 1:end]
    assert len(rows) == len(group.commands), rows  # one line each, at 80 columns
    for (name, command), row in zip(group.commands.items(), rows):
        summary = docstring(command).splitlines()[0]
        assert row.split() == ["│", name, *summary.split(), "│"], (name, row)


def test_a_commands_help_is_its_docstring_in_paragraphs_that_the_terminal_wraps():
    """No line break of the source inside a sentence: at 400 columns each paragraph is one
    line; lines under a `\\b` line (examples) stay as written, without the mark."""
    checked = 0
    for path, command in every_command():
        if not path:
            continue
        out = vrl(*path, "--help", columns=400).stdout
        lines = [line.strip() for line in out.splitlines()]
        assert "\b" not in out
        for paragraph in docstring(command).split("\n\n"):
            if paragraph.startswith("\b\n"):
                for line in paragraph.splitlines()[1:]:
                    assert line.strip() in lines, (path, line)
            else:
                assert " ".join(paragraph.split()) in lines, (path, paragraph)
            checked += 1
    assert checked > 25  # every command's every paragraph (the trainer alone has four)


def test_no_flag_shows_a_type():
    """A flag takes no value: `--help <bool>` and `--log-shards <bool>` said it did."""
    for path, _ in every_command():
        out = vrl(*path, "--help").stdout
        assert "<bool>" not in out and re.search(r"--help +Show this message", out), path
    assert re.search(r"--version +Print the installed version", vrl("--help").stdout)
    assert re.search(r"--no-curriculum +Fill each version's prompt pool",
                     vrl("trainer", "--help").stdout)


def test_help_names_no_source_file_or_module():
    """Help is for people who run vrl, not for its code's readers: no `task/curriculum.py`,
    no `devices.sampling_threads`. The entry point group volunteer_rl.tasks is a name plugin
    authors write, so it may appear, and a bucket object's name (fleet.json) is no module."""
    package = Path(volunteer_rl.__file__).parent
    modules = {p.stem for p in package.rglob("*.py")} | {
        p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    modules -= {"__init__", "__main__"}
    internal = re.compile(r"\.py\b|volunteer_rl/|volunteer_rl\.(?!tasks\b)|"
                          r"\b(%s)\.(?!json\b|html\b|png\b|csv\b)[A-Za-z_]"
                          % "|".join(sorted(modules)))
    found = []
    for path, _ in every_command():
        out = vrl(*path, "--help", columns=400).stdout
        found += [f"vrl {' '.join(path)}: {m.group(0)!r} in {line.strip()[:120]}"
                  for line in out.splitlines() for m in [internal.search(line)] if m]
    assert found == []


def test_the_volunteer_shows_only_the_options_it_uses_and_still_takes_an_old_seed(built,
                                                                                   tmp_path):
    """Its Model panel held one option, --seed, which nothing has read since schema 6: no
    setting holds it now, and it is accepted, unshown, for the command lines of older builds
    (the integration tests' among them)."""
    assert "seed" not in {f.name for f in fields(VolunteerConfig)}
    out = vrl("volunteer", "--help").stdout
    panels = set(re.findall(r"╭─ ([A-Za-z ]+?) ─", out))
    assert panels == {"Options", "Storage", "Volunteering", "Run and reports", "Machine", "Trust"}
    assert "--seed" not in out
    r = vrl("volunteer", "--bucket", str(tmp_path), "--id", "v", "--seed", "7")
    assert r.exit_code == 0, r.output
    assert built == [VolunteerConfig(bucket=str(tmp_path), volunteer_id="v")]
    (tmp_path / "v.toml").write_text('seed = 7\n')  # nor does a config file that sets it fail
    assert vrl("volunteer", "--bucket", str(tmp_path), "--config", str(tmp_path / "v.toml")
               ).exit_code == 0


def code_rooms() -> dict[str, set[str]]:
    """{room: its modules} of volunteer_rl/, the top-level modules under "shared"."""
    package = Path(volunteer_rl.__file__).parent
    rooms = {room.name: {p.stem for p in room.glob("*.py")} - {"__init__"}
             for room in package.iterdir() if (room / "__init__.py").exists()}
    rooms["shared"] = {p.stem for p in package.glob("*.py")} - {"__init__"}
    return rooms


def test_architecture_names_every_module_in_its_room():
    """docs/ARCHITECTURE.md's table of rooms names every module of volunteer_rl/, in its own
    row (`demo.py` has a row of its own), so the map cannot fall behind the code again."""
    page = (Path(__file__).parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    rows = dict(re.findall(r"^\| (.+?) \| (.+) \|$", page, re.M))
    cells = {room: next(cell for head, cell in rows.items() if head.startswith(f"`{room}/`"))
             for room in code_rooms() if room != "shared"}
    cells["shared"] = rows["shared"] + " `demo`" * ("`demo.py`" in rows)
    missing = [f"{room}: {module}" for room, modules in code_rooms().items()
               for module in sorted(modules) if f"`{module}`" not in cells[room]]
    assert missing == []


def test_the_readme_layout_names_every_module_in_its_room():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("## Layout of the code", 1)[1].split("```")[1]
    rooms, room = {}, None
    for line in block.splitlines():
        head = re.match(r"  (\w+)/ ", line) or re.match(r"  (\w+\.py) ", line)
        if head:
            room = "shared" if head.group(1).endswith(".py") else head.group(1)
        elif not line.startswith("     "):
            room = None  # a line of another folder than volunteer_rl/
        if room:
            rooms[room] = rooms.get(room, "") + line
    missing = [f"{room}: {module}" for room, modules in code_rooms().items()
               for module in sorted(modules)
               if not re.search(rf"\b{module}\b", rooms.get(room, ""))]
    assert missing == []


def test_the_short_try_of_a_task_that_the_docs_give_is_a_demo_command_line(built):
    """README's Tasks and docs/TASKS.md give `vrl demo --task NAME` with a short warm start:
    every such line is one `vrl demo` takes (its options exist and accept those values)."""
    root = Path(__file__).parents[2]
    pages = (root / "README.md").read_text() + (root / "docs" / "TASKS.md").read_text()
    lines = re.findall(r"`(vrl demo --task [^`]+)`", " ".join(pages.split()))
    assert any("--warm-start-steps" in line and "--rl-seconds" in line for line in lines), lines
    for line in lines:
        args = re.sub(r"--task \S+", "--task countdown", line).split()[1:]  # one installed here
        r = vrl(*args)
        assert r.exit_code == 0, (line, r.output)
    assert built and all(s.task == "countdown" for s in built)
    assert {(s.warm_start_steps, s.rl_seconds) for s in built} >= {(200, 60.0)}
