"""Finding tasks: every task is an installed Python entry point of the group `volunteer_rl.tasks`,
vrl's own two (calculator, countdown) included. Nothing is ever loaded from a bucket: a
manifest names a task, its package and the package's version, and a volunteer runs the task
only if that package is installed on its own machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

from volunteer_rl.errors import VrlError
from volunteer_rl.protocol.manifest import TASK_NAME, TaskRef
from volunteer_rl.protocol.printable import printable
from volunteer_rl.task.base import Task

GROUP = "volunteer_rl.tasks"
INSTALL_GUIDE = "docs/TASKS.md, Installing a task a manifest names"
"""Where a volunteer refusing a manifest's task is sent: how to install a task it trusts. The
refusal never prints a command: the package it names is the manifest's text, and the manifest
may come from a bucket whose key the volunteer only pinned on first use."""
BUILT_IN = {
    "calculator": ("volunteer_rl.task.calculator_task:CalculatorTask", "volunteer-rl"),
    "countdown": ("volunteer_rl.task.countdown:CountdownTask", "volunteer-rl"),
}
"""vrl's own tasks, also declared as entry points in pyproject.toml; listed here too so a
checkout run without installing (PYTHONPATH) still has them."""


class TaskError(VrlError):
    """A task is unknown, not installed, of another version, or broken. One line."""


@dataclass(frozen=True)
class TaskInfo:
    """An installed task: its name, the object its entry point names ("module:Class") and the
    distribution that provides it."""

    name: str
    value: str
    package: str
    version: str

    @property
    def ref(self) -> TaskRef:
        """How a manifest names this task: name, package and the package's version."""
        return TaskRef(self.name, self.package, self.version)


def _own_version() -> str:
    from volunteer_rl import __version__
    return __version__


def installed() -> dict[str, TaskInfo]:
    """Every task installed here, by name (an installed package's entry point wins over a
    built-in of the same name only if it is vrl's own)."""
    found = {name: TaskInfo(name, value, package, _own_version())
             for name, (value, package) in BUILT_IN.items()}
    for ep in metadata.entry_points(group=GROUP):
        if not TASK_NAME.fullmatch(ep.name):  # the manifest could not name it
            continue
        dist = getattr(ep, "dist", None)
        package = dist.metadata["Name"] if dist is not None else "?"
        version = dist.version if dist is not None else "?"
        if ep.name in BUILT_IN and ep.value != BUILT_IN[ep.name][0]:
            continue  # another package may not take a built-in name
        found[ep.name] = TaskInfo(ep.name, ep.value, package, version)
    return found


def info(name: str) -> TaskInfo:
    """The installed task `name`; TaskError naming the installed ones if there is none."""
    tasks = installed()
    if name not in tasks:
        raise TaskError(f"task {name!r} is not installed (installed: {', '.join(sorted(tasks))}); "
                        f"a task is a package that declares the entry point group {GROUP!r}")
    return tasks[name]


def load_object(value: str) -> Task:
    """Import "module:Class" and make the task; TaskError if that fails or is no Task."""
    module, _, attr = value.partition(":")
    try:
        import importlib
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        task = obj() if isinstance(obj, type) else obj
    except Exception as exc:
        raise TaskError(f"task {value}: cannot load ({type(exc).__name__}: {exc})"
                        .replace("\n", " ")) from None
    if not isinstance(task, Task):
        raise TaskError(f"task {value}: is not a volunteer_rl.task.base.Task")
    return task


def load(name: str) -> tuple[Task, TaskInfo]:
    """The installed task `name`, loaded, with where it came from."""
    found = info(name)
    task = load_object(found.value)
    if getattr(task, "name", None) != name:
        raise TaskError(f"task {name!r}: {found.value} calls itself {getattr(task, 'name', None)!r}")
    return task, found


def for_manifest(ref: TaskRef, what: str = "manifest.json") -> tuple[Task, TaskInfo]:
    """The task a manifest names, from this machine's installed packages: the same name from
    the same package at the same version. TaskError otherwise, one line saying what is
    missing, quoted as the manifest's words (escaped), and where to read how to install a
    task: never a command built from them; a different version may write other prompts or
    score otherwise, and every shard sampled with it would be refused."""
    name, package, version = (printable(s) for s in (ref.name, ref.package, ref.version))
    named = f"the manifest names package '{package}' version '{version}'"
    found = installed().get(ref.name)
    if found is None:
        raise TaskError(f"{what}: task '{name}' is not installed here; {named} "
                        f"(to install a task you trust: {INSTALL_GUIDE})")
    if (canonical(found.package), found.version) != (canonical(ref.package), ref.version):
        raise TaskError(f"{what}: task '{name}' is installed from {found.package} "
                        f"{found.version}; {named} (to install a task you trust: {INSTALL_GUIDE})")
    return load(ref.name)


def canonical(package: str) -> str:
    """A distribution name as pip compares them (PEP 503): case and -_. runs folded."""
    return re.sub(r"[-_.]+", "-", package).lower()
