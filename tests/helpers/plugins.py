"""Task plugins for tests: install a plugin package (examples/vrl-task-sort) with real pip
into a folder of its own, to put on the PYTHONPATH of the `vrl` processes a test starts.

pip builds a local project in its own folder (build/, *.egg-info), so the package is copied
into a scratch folder first and built there: examples/ stays clean, and two pytest-xdist
workers installing at once each build their own copy into their own target. Offline: no
index, no dependencies (volunteer-rl is the venv's own), the venv's setuptools as backend.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SORT_PACKAGE = ROOT / "examples" / "vrl-task-sort"


def install_plugin(package_dir: Path, dest: Path, timeout: float = 120) -> Path:
    """pip-install `package_dir` into `dest`/target (a new folder, built from a copy in
    `dest`/src); the target, to be put on PYTHONPATH (plugin_env)."""
    src, target = dest / "src", dest / "target"
    shutil.copytree(package_dir, src, ignore=shutil.ignore_patterns(
        "build", "dist", "*.egg-info", "__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                        "--no-index", "--no-cache-dir", "--disable-pip-version-check", "--quiet",
                        "--target", str(target), str(src)],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"pip install {package_dir} failed:\n{r.stdout}\n{r.stderr}"
    return target


def plugin_env(target: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with `target` first on PYTHONPATH. Pass it as a Proc's
    or subprocess's env (vrl_env adds it over os.environ)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="session")
def sort_plugin(tmp_path_factory) -> Path:
    """examples/vrl-task-sort installed once per pytest worker: the target folder. Use it in a
    test module with `sort_plugin = plugins.sort_plugin` (pytest finds fixtures by module
    attribute; an assignment, unlike an import, does not trip pyflakes)."""
    return install_plugin(SORT_PACKAGE, tmp_path_factory.mktemp("plugin-sort"))
