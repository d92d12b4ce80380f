"""The install is reproducible: every dependency pyproject.toml names is pinned in
requirements.lock, the pins satisfy pyproject's bounds, and the README's two commands install
from the lock (CI runs the test line as written, so it must stay parseable)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
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


# --- the wheel DEPLOY.md tells operators to build and volunteers to install ----------------------

DEPLOY = ROOT / "docs" / "DEPLOY.md"
OFFLINE = ["--no-index", "--no-cache-dir", "--disable-pip-version-check", "--quiet"]


def deploy_line(part: str) -> str:
    """The one line of DEPLOY.md's code that holds `part`, its comment cut off."""
    (line,) = [line for line in DEPLOY.read_text().splitlines()
               if part in line and not line.startswith(("`", "-", "*"))]
    return line.split("#")[0].strip()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built by DEPLOY.md's line, in a copy of the sources (pip builds in the tree:
    build/ and *.egg-info stay out of the checkout), offline: the venv's setuptools."""
    src = tmp_path_factory.mktemp("wheel") / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in ("volunteer_rl", "cli"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    line = deploy_line("pip wheel")
    assert line == "pip wheel --no-deps -w dist ."
    r = subprocess.run([sys.executable, "-m", *line.split(), "--no-build-isolation", *OFFLINE],
                       cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = (src / "dist").glob("*.whl")
    return built


def test_the_wheel_holds_every_module_and_the_gcs_extra(wheel):
    version = pyproject()["project"]["version"]
    assert wheel.name == f"volunteer_rl-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"volunteer_rl-{version}.dist-info/METADATA").decode()
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "volunteer_rl").rglob("*.py")}
    sources |= {"volunteer_rl_cli/" + str(p.relative_to(ROOT / "cli")) for p in (ROOT / "cli").rglob("*.py")}
    assert sources - names == set()  # a subpackage missing from pyproject's list is missing here
    assert "Provides-Extra: gcs" in meta and re.search(r'Requires-Dist: gcsfs.*extra == "gcs"', meta)


def test_the_documented_install_line_gives_a_working_vrl(wheel, tmp_path):
    """DEPLOY.md's laptop lines, run: a fresh virtualenv with the wheel installed from its file
    (offline, --no-deps: the dependencies are this venv's, on a .pth line, as pip would have
    fetched them by the lock), whose `vrl` is the wheel's code, not the checkout's."""
    install = deploy_line("vrl-env/bin/pip install ./")
    assert install.startswith("python3 -m venv vrl-env && vrl-env/bin/pip install ") and \
        f"./{wheel.name} -c requirements.lock" in install
    assert deploy_line("whl[gcs]'") == f"vrl-env/bin/pip install './{wheel.name}[gcs]'"
    env_dir = tmp_path / "vrl-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    python = env_dir / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                        *OFFLINE, f"./{wheel.name}", "-c", str(ROOT / "requirements.lock")],
                       cwd=wheel.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*args: str) -> str:
        r = subprocess.run([*args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        return r.stdout

    vrl = str(env_dir / "bin" / "vrl")
    assert pyproject()["project"]["version"] in run(vrl, "--version")
    assert "--trust-key" in run(vrl, "volunteer", "--help")
    assert "calculator" in run(vrl, "tasks")
    where = run(str(python), "-c", "import volunteer_rl.volunteer.loop as v, volunteer_rl_cli.main as c; "
                                   "print(v.__file__); print(c.__file__)")
    assert all(line.startswith(str(site)) for line in where.split()), where
