"""The calculator task's reward, and what a rewarded completion may contain.

The rule: reward 1 only when the whole completion is one expression followed by EOS
(whitespace allowed around it); nothing after EOS; special tokens only as that EOS. The
expression must evaluate (safely) to the target's value, so any equivalent expression counts,
not just the canonical spelling.

Why so strict: volunteers are untrusted and every completion they upload can end up in a
gradient step. A lenient reader (first line, code fences, "A:" prefixes, text after EOS or
hidden behind skipped special tokens) would give a positive advantage to whatever rides along
with a correct expression, and training would teach the policy to write that payload. Under
this rule a rewarded completion carries nothing but the expression.

`reward` judges decoded text (task.calculator_task wraps it as a Task); `completion_reward`
judges sampled token ids for a target expression.
"""

from __future__ import annotations

import math
from typing import Callable

from volunteer_rl.task.base import completion_text
from volunteer_rl.task.calculator import safe_eval

# -----------------------------------------------------------------------------
# Text -> reward


def _is_one_expression(text: str) -> bool:
    """True iff `text` (already stripped) is one line, with no comment and no trailing '.'.

    Python's parser reads "(1 +\\n 2)" and "9  # anything" as one expression, and both would
    smuggle text; "9." is a float to it but a sentence's full stop to a reader."""
    return (bool(text) and "#" not in text and not text.endswith(".")
            and len(text.splitlines()) == 1)


def reward(completion: str, target_expression: str) -> float:
    """1.0 iff `completion`, stripped of surrounding whitespace, is exactly one expression
    that evaluates to the target's value, else 0.0. Never raises.

    No second line, trailing text, comment, code fence, "A:" style prefix or trailing '.'.
    Values are compared with math.isclose(rel_tol=1e-9, abs_tol=1e-9), so any equivalent
    expression (e.g. `3*(2+1)` for `(1 + 2) * 3`) earns full reward.
    """
    try:
        if not isinstance(completion, str):
            return 0.0
        target = safe_eval(target_expression)
        if target is None:
            return 0.0
        text = completion.strip()
        got = safe_eval(text)  # refuses over-long text before parsing it
        if got is None or not _is_one_expression(text):
            return 0.0
        return 1.0 if math.isclose(got, target, rel_tol=1e-9, abs_tol=1e-9) else 0.0
    except Exception:  # reward is called in the training loop: never take it down
        return 0.0


# -----------------------------------------------------------------------------
# Token ids -> reward


def completion_reward(token_ids: list[int], target_expression: str,
                      decode: Callable[[list[int]], str], eos_id: int,
                      special_ids: frozenset[int] | set[int]) -> float:
    """The calculator's reward of sampled token ids, under vrl's rule for every task
    (base.completion_text: ends at its first EOS, no other special token); for tests and
    benches that hold a target expression rather than a row. Never raises."""
    text = completion_text(token_ids, decode, eos_id, special_ids)
    return 0.0 if text is None else reward(text, target_expression)
