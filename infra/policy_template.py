"""Render terraform's policy templates (terraform/*/policies/*.json.tftpl) in Python.

The templates use only terraform's `${name}` interpolation of plain variables, which is all
this renderer supports; anything else (`%{...}` directives, `$${` escapes, expressions inside
`${...}`) makes it raise, so a template that terraform would render differently cannot pass
the tests silently.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")
_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def template_variables(text: str) -> set[str]:
    """The variable names a template interpolates."""
    names = set()
    for expression in _INTERPOLATION.findall(text):
        if not _PLAIN_NAME.match(expression):
            raise ValueError(f"unsupported template expression: ${{{expression}}}")
        names.add(expression)
    return names


def render(text: str, variables: dict[str, str]) -> str:
    """Substitute `${name}` like terraform's templatefile() does for string variables."""
    if "%{" in text or "$${" in text:
        raise ValueError("template directives and escapes are not supported by this renderer")
    missing = template_variables(text) - variables.keys()
    if missing:
        # templatefile() fails the same way on a variable it was not given.
        raise KeyError(f"template needs variables not given: {sorted(missing)}")
    return _INTERPOLATION.sub(lambda m: str(variables[m.group(1)]), text)


def render_file(path: str | Path, **variables: str) -> str:
    return render(Path(path).read_text(encoding="utf-8"), variables)


def render_policy(path: str | Path, **variables: str) -> dict:
    """Render a policy template and parse it as JSON."""
    return json.loads(render_file(path, **variables))
