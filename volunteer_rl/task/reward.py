"""The calculator task's reward: 1.0 iff the expression a completion writes evaluates (safely)
to the same number as the target, so any equivalent expression counts, not just the canonical
spelling. extract_expression finds that expression in a raw completion.
"""

from __future__ import annotations

import math
import re

from volunteer_rl.task.calculator import safe_eval

# -----------------------------------------------------------------------------
# Completion -> expression -> reward

_FENCE_LANG = re.compile(r"[A-Za-z0-9_+-]*")
_PREFIX = re.compile(
    r"^(?:(?:a|answer|expression|expr|python|result|output)\s*[:=]|=|>>>)\s*", re.IGNORECASE
)


def _first_nonempty_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def extract_expression(completion: str) -> str:
    """The expression part of a model completion.

    First non-empty line, stripped; strips a surrounding ``` code fence
    (```python ... ```), inline backticks, and a leading 'A:' / '=' style
    prefix; trailing '.' removed.
    """
    if not isinstance(completion, str):
        return ""
    text = completion.strip()
    if text.startswith("```"):
        body = text[3:]
        fence_line, newline, rest = body.partition("\n")
        if newline and _FENCE_LANG.fullmatch(fence_line.strip()):
            body = rest  # drop the language tag line, e.g. "python"
        text = body.split("```", 1)[0]  # stop at the closing fence
    line = _first_nonempty_line(text)
    # a couple of rounds handle nestings like "A: `1 + 2`" and "`= 1 + 2`"
    for _ in range(3):
        line = _PREFIX.sub("", line).strip()
        inline = re.match(r"^`+([^`]*)`+", line)
        line = (inline.group(1) if inline else line.strip("`")).strip()
    return line.rstrip(".").strip()


def reward(completion: str, target_expression: str) -> float:
    """1.0 iff the completion's expression evaluates to the target's value, else 0.0. Never raises.

    Values are compared with math.isclose(rel_tol=1e-9, abs_tol=1e-9), so any
    equivalent expression (e.g. `3*(2+1)` for `(1 + 2) * 3`) earns full reward.
    """
    try:
        target = safe_eval(target_expression)
        if target is None:
            return 0.0
        got = safe_eval(extract_expression(completion))
        if got is None:
            return 0.0
        return 1.0 if math.isclose(got, target, rel_tol=1e-9, abs_tol=1e-9) else 0.0
    except Exception:  # reward is called in the training loop: never take it down
        return 0.0
