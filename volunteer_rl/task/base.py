"""What a task is: the contract between vrl and a verifiable task, built in or installed.

A task says which dataset columns it reads, how a row becomes the prompt's text, the reward
of a completion's text for a row (a number in [0, 1]), what counts as correct in evaluation,
the sampling settings it suggests and the bounds its reward needs. Everything else (the
model, sampling, shards, audits, the optimizer) is vrl's and the same for every task.

A completion's token ids reach a task only through `completion_reward` below, which applies
vrl's own rule first: a rewarded completion ends at its first EOS and holds no other special
token, so nothing can ride along behind the answer or hide in a token the decoder skips. The
task then judges the text before that EOS.

Tasks are pure Python and must be deterministic: the trainer recomputes every reward a
volunteer claims and refuses the shard when they differ. They never see torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Mapping

# -----------------------------------------------------------------------------
# Rows


@dataclass(frozen=True)
class Row:
    """One dataset row: its 0-based index in the CSV (the prompt id of every group sampled for
    it) and the values of the columns its task reads, stripped."""

    id: int
    fields: Mapping[str, str]

    def __getitem__(self, column: str) -> str:
        return self.fields[column]


# -----------------------------------------------------------------------------
# The interface


class Task:
    """Subclass this, fill the class attributes, write `prompt` and `reward`; register the
    class under the entry-point group `volunteer_rl.tasks` (docs/TASKS.md)."""

    name: ClassVar[str]
    """The task's name on the command line and in manifest.json: 1-40 of [A-Za-z0-9_.-]."""
    columns: ClassVar[tuple[str, ...]]
    """Dataset CSV columns the task reads; other columns are ignored."""
    instruction: ClassVar[str] = "{question}"
    """The user message of a chat-format prompt, `{question}` standing for `prompt(row)`. A
    plain-format prompt is `Q: <prompt(row)>\\nA: ` and does not use it."""
    k: ClassVar[int] = 8
    """Completions per prompt the task suggests (`vrl trainer --k` overrides it)."""
    max_new_tokens: ClassVar[int] = 32
    """Tokens per completion the task suggests (`vrl trainer --max-new-tokens` overrides it)."""
    reward_seconds: ClassVar[float] = 1.0
    """CPU-time bound of one completion's reward in the trainer; over it, the shard holding
    the completion is refused (`reward_timeout`)."""
    reward_memory_mb: ClassVar[int] = 256
    """Memory a reward may allocate, beyond what the loaded task holds; over it, the shard is
    refused (`reward_memory`)."""

    def check(self, row: Row) -> str | None:
        """Why a row cannot be used (e.g. "target 'x' does not evaluate"), or None. Called
        on every row when a dataset is read: a bad row stops the run with one line."""
        return None

    def prompt(self, row: Row) -> str:
        """The question the model is asked for `row`."""
        raise NotImplementedError

    def reward(self, completion: str, row: Row) -> float:
        """The reward of `completion` (the text before EOS) for `row`, in [0, 1]. May be
        called on hostile text: it must not execute it."""
        raise NotImplementedError

    def correct(self, completion: str, row: Row) -> bool:
        """Whether evaluation counts `completion` as solving `row`: full reward by default."""
        return self.reward(completion, row) >= 1.0

    def reference(self, row: Row) -> str | None:
        """One right answer for `row`, or None: the tiny model's tokenizer and its supervised
        warm start train on these (`--model tiny` needs them)."""
        return None

    def stratum(self, row: Row) -> int:
        """Difficulty class of `row` (0-8), which the curriculum balances; one class by default."""
        return 0

    def data(self) -> tuple[Path, Path] | None:
        """The task's own (train, held-out) CSVs, used when the trainer is given none."""
        return None


# -----------------------------------------------------------------------------
# Token ids -> reward (vrl's rule around the task's)


def completion_text(token_ids: list[int], decode: Callable[[list[int]], str], eos_id: int,
                    special_ids: frozenset[int] | set[int]) -> str | None:
    """The text a task judges: the completion before its EOS, decoded with special tokens
    spelled out; None when the completion has no EOS at its end (cut off at the token cap),
    an EOS earlier, or another special token. Never raises.

    `decode` must NOT skip special tokens (Policy.decode_all): a special token missing from
    `special_ids` then shows up as text the task sees, instead of vanishing from it."""
    try:
        ids = list(token_ids)
        if not ids or ids[-1] != eos_id:
            return None
        body = ids[:-1]
        if any(t == eos_id or t in special_ids for t in body):
            return None
        return decode(body)
    except Exception:  # called on volunteers' uploads: never raise
        return None


def clamp_reward(value) -> float | None:
    """A task's reward as a float in [0, 1], or None when it is not a finite real number."""
    if type(value) is bool or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return min(1.0, max(0.0, float(value)))


def text_reward(task: Task, text: str, row: Row) -> float:
    """The task's reward of a completion's text, in-process: a task that raises or returns a
    non-number gives 0, anything else is clamped into [0, 1]. task.bounded gives the very
    same values, in a worker process under the task's bounds."""
    try:
        return clamp_reward(task.reward(text, row)) or 0.0
    except Exception:
        return 0.0


def in_process(task: Task) -> Callable[[list[tuple[str, Row]]], list[float]]:
    """Rewards of (text, row) pairs computed here, without bounds (a batch's bounds, `spend`,
    are ignored): the same values as task.bounded.BoundedRewards.rewards, for unit tests and
    benches of the intake."""
    return lambda items, spend=None: [text_reward(task, text, row) for text, row in items]


def completion_reward(task: Task, row: Row, token_ids: list[int],
                      decode: Callable[[list[int]], str], eos_id: int,
                      special_ids: frozenset[int] | set[int]) -> float:
    """The reward of a sampled completion, in-process: 0 when vrl's rule refuses it (see
    completion_text), else the task's. For a volunteer's own samples and the trainer's
    evaluation; the trainer's intake runs rewards under the task's bounds (task.bounded).
    A task that raises or returns a non-number gives 0."""
    text = completion_text(token_ids, decode, eos_id, special_ids)
    return 0.0 if text is None else text_reward(task, text, row)
