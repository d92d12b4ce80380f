"""Dataset files: reading a task's CSV into Rows (`load_rows`, one-line DatasetError naming file
and row), the sha256 that pins which file a run trained on, and the calculator's own CSV
format (Problem, load_csv, write_csv), which its generator, tests and benches use.

A calculator problem is a sentence such as

    "add 12, 3, and 37, multiply that sum by 14, then subtract 15."

and its target is the Python expression ``(12 + 3 + 37) * 14 - 15``. The shipped train and
eval files are in data/ (task.generate made them).
"""

from __future__ import annotations

import csv
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from volunteer_rl.errors import VrlError
from volunteer_rl.task.base import Row, Task
from volunteer_rl.task.calculator import safe_eval

# -----------------------------------------------------------------------------
# Problems and dataset errors


@dataclass(frozen=True)
class Problem:
    """One task instance. id is the 0-based data row index in its CSV."""

    id: int
    prompt: str  # the English text (CSV column natural_language)
    expression: str  # the target Python expression (CSV column python_expression)

    @property
    def row(self) -> Row:
        """The problem as the calculator task's dataset row."""
        return Row(self.id, {EXPRESSION_COLUMN: self.expression, PROMPT_COLUMN: self.prompt})


class DatasetError(VrlError, ValueError):
    """A dataset file is missing or malformed. The message is one line naming the file."""


# -----------------------------------------------------------------------------
# Reading and writing a CSV (any task's, the calculator's)


def load_rows(path, task: Task) -> list[Row]:
    """The rows of a CSV whose header holds the task's columns (others ignored, order free),
    each checked by `task.check`. Raises DatasetError (one line, naming the file and row) for
    a missing, empty or unreadable file, a missing column or a row the task refuses. Row ids
    are the 0-based data row indices."""
    return _read(path, task.columns, task.check, f" for task {task.name!r}")


def _read(path, columns: tuple[str, ...], check, whose: str = "") -> list[Row]:
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's BOM
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise DatasetError(f"{path}: empty file (no header row)")
            fields = [(name or "").strip() for name in reader.fieldnames]
            reader.fieldnames = fields  # tolerate ' natural_language' style headers
            for column in columns:
                if column not in fields:
                    raise DatasetError(f"{path}: missing column {column!r}{whose} (header has "
                                       f"{fields})")
            rows = []
            for i, raw in enumerate(reader):
                row = Row(i, {c: (raw.get(c) or "").strip() for c in columns})
                try:
                    why = check(row)
                except Exception as exc:  # a task's bug, reported like a bad row
                    why = f"the task cannot check it ({type(exc).__name__}: {exc})"
                if why:
                    why = str(why).replace("\n", " ")
                    raise DatasetError(f"{path}: row {i} (line {reader.line_num}): {why}")
                rows.append(row)
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DatasetError(f"{path}: is a directory, not a CSV file") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise DatasetError(f"{path}: cannot read as UTF-8 CSV: {e}".replace("\n", " ")) from None
    if not rows:
        raise DatasetError(f"{path}: no data rows")
    return rows


def write_rows(path, header: tuple[str, ...], records) -> None:
    """Write a CSV (header, then one list of strings per record) atomically: a temporary file
    in the same folder, then os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(header)
            writer.writerows(records)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary shared data files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


EXPRESSION_COLUMN = "python_expression"
PROMPT_COLUMN = "natural_language"


def calculator_check(row: Row) -> str | None:
    """Why a calculator row cannot be used (an empty prompt, a target that does not
    evaluate), or None: the calculator task's `check`."""
    if not row[PROMPT_COLUMN]:
        return f"empty {PROMPT_COLUMN}"
    if safe_eval(row[EXPRESSION_COLUMN]) is None:
        return f"{EXPRESSION_COLUMN} {quoted(row[EXPRESSION_COLUMN])} does not evaluate"
    return None


def quoted(text: str) -> str:
    """A row's field for a one-line message: its repr (control characters escaped), cut to
    60 characters."""
    return repr(text if len(text) <= 60 else text[:57] + "...")


def load_csv(path) -> list[Problem]:
    """A calculator CSV (header columns python_expression,natural_language; extra columns
    ignored, order free) as Problems. DatasetError as for load_rows."""
    return [Problem(r.id, r[PROMPT_COLUMN], r[EXPRESSION_COLUMN])
            for r in _read(path, (EXPRESSION_COLUMN, PROMPT_COLUMN), calculator_check)]


def write_csv(path, problems) -> None:
    """Write problems with header python_expression,natural_language; atomic."""
    write_rows(path, (EXPRESSION_COLUMN, PROMPT_COLUMN),
               ([p.expression, p.prompt] for p in problems))


def file_sha256(path) -> str:
    """Hex sha256 of a file's bytes (used to pin which dataset a run trained on)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
