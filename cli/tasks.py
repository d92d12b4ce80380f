"""`vrl tasks`: the tasks installed here (volunteer_rl.task.registry)."""

from __future__ import annotations

import typer

from volunteer_rl_cli.options import log

app = typer.Typer()


@app.command()
def tasks(
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Also show each task's columns, sampling and reward bounds."),
):
    """List the tasks installed here, the ones a run can use.

    `vrl trainer --task NAME` trains one, and a volunteer samples a run's task only where it
    is installed too. The list holds vrl's own (calculator, countdown) and those of every
    installed package that declares the entry point group volunteer_rl.tasks (docs/TASKS.md
    says how to write one).

    Example: vrl tasks --verbose
    """
    from volunteer_rl.task.registry import TaskError, installed, load

    found = installed()
    width = max(len(name) for name in found)
    for name, info in sorted(found.items()):
        line = f"{name:<{width}}  {info.package} {info.version}  ({info.value})"
        if verbose:
            try:
                task, _ = load(name)
                line += (f"\n{'':<{width}}  columns {', '.join(task.columns)}; k {task.k}, "
                         f"max_new_tokens {task.max_new_tokens}; reward within "
                         f"{task.reward_seconds:g} s and {task.reward_memory_mb} MiB")
            except TaskError as exc:
                line += f"\n{'':<{width}}  cannot load: {exc}"
        log(line)
