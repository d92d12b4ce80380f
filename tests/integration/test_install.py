"""The install is reproducible: every dependency pyproject.toml names is pinned in
requirements.lock, the pins satisfy pyproject's bounds, and the README's two commands install
from the lock (CI runs the test line as written, so it must stay parseable)."""
from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is 3.11+")


def pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def lock_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==(\S+)$", line)
        if m:
            pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    return pins


def locked_requirements() -> list[Requirement]:
    """Runtime and test requirements: what the README's two commands install."""
    project = pyproject()["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def test_every_dependency_is_pinned_within_its_bounds():
    pins = lock_pins()
    for req in locked_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is in pyproject.toml but not in requirements.lock: run scripts/refresh-lock"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"requirements.lock pins {name}=={pins[name]}, outside pyproject's {req}"


def test_lock_pins_torch_cpu_release_without_cuda_packages():
    pins = lock_pins()
    assert pins["torch"] == Version("2.13.0")
    assert not [n for n in pins if n.startswith(("nvidia-", "cuda-", "triton"))]


def test_installed_versions_are_the_locked_ones():
    """This environment was installed from the lock (as the README says): a drifted install
    is caught here rather than by a puzzling failure elsewhere."""
    pins = lock_pins()
    for req in locked_requirements():
        name = canonicalize_name(req.name)
        installed = Version(metadata.version(name))
        assert installed.public == pins[name].public, f"{name} {installed} installed, lock says {pins[name]}"


def test_readme_commands_install_from_the_lock():
    lines = (ROOT / "README.md").read_text().splitlines()
    demo = [line for line in lines if line.rstrip().endswith("# run the demo")]
    tests = [line for line in lines if line.rstrip().endswith("# run the tests")]
    assert len(demo) == 1 and len(tests) == 1
    for line in demo + tests:
        assert "-c requirements.lock" in line and "python3 -m venv .venv" in line
    assert demo[0].split("#")[0].rstrip().endswith("vrl demo")
    # .ci/run splits the test line at its last `&&`: set-up before, test command after.
    assert tests[0].split("#")[0].rstrip().rsplit(" && ", 1)[1] == ".venv/bin/python -m pytest -q -n 2 --dist loadfile"
