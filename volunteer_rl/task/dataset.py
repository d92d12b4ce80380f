"""The calculator task's dataset files: one Problem per row, the CSV format, reading it (one-line
DatasetError naming file and row), writing it atomically, and the sha256 that pins which file
a run trained on.

A problem is a sentence such as

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
from volunteer_rl.task.calculator import safe_eval

# -----------------------------------------------------------------------------
# Problems and dataset errors


@dataclass(frozen=True)
class Problem:
    """One task instance. id is the 0-based data row index in its CSV."""

    id: int
    prompt: str  # the English text (CSV column natural_language)
    expression: str  # the target Python expression (CSV column python_expression)


class DatasetError(VrlError, ValueError):
    """A dataset file is missing or malformed. The message is one line naming the file."""


# -----------------------------------------------------------------------------
# CSV files

EXPRESSION_COLUMN = "python_expression"
PROMPT_COLUMN = "natural_language"


def load_csv(path) -> list[Problem]:
    """Load a CSV with header columns python_expression,natural_language (extra columns
    ignored, order free).

    Raises DatasetError (one line, naming the file and row) for: missing file,
    empty file, missing column, an empty prompt, or an expression that does
    not safe_eval. Problem ids are the 0-based data row indices.
    """
    path = Path(path)
    try:
        # utf-8-sig: tolerate a BOM from spreadsheet exports
        with open(path, newline="", encoding="utf-8-sig") as f:
            return _read_rows(path, csv.DictReader(f))
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DatasetError(f"{path}: is a directory, not a CSV file") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise DatasetError(f"{path}: cannot read as UTF-8 CSV: {e}".replace("\n", " ")) from None


def _read_rows(path: Path, reader: csv.DictReader) -> list[Problem]:
    if reader.fieldnames is None:
        raise DatasetError(f"{path}: empty file (no header row)")
    fields = [(name or "").strip() for name in reader.fieldnames]
    reader.fieldnames = fields  # tolerate ' natural_language' style headers
    for column in (EXPRESSION_COLUMN, PROMPT_COLUMN):
        if column not in fields:
            raise DatasetError(f"{path}: missing column {column!r} (header has {fields})")
    problems = []
    for i, row in enumerate(reader):
        where = f"{path}: row {i} (line {reader.line_num})"
        expression = (row.get(EXPRESSION_COLUMN) or "").strip()
        prompt = (row.get(PROMPT_COLUMN) or "").strip()
        if not prompt:
            raise DatasetError(f"{where}: empty {PROMPT_COLUMN}")
        if safe_eval(expression) is None:
            shown = expression if len(expression) <= 60 else expression[:57] + "..."
            raise DatasetError(f"{where}: {EXPRESSION_COLUMN} {shown!r} does not evaluate")
        problems.append(Problem(i, prompt, expression))
    if not problems:
        raise DatasetError(f"{path}: no data rows")
    return problems


def write_csv(path, problems) -> None:
    """Write problems with header python_expression,natural_language; atomic (tmp file +
    os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow([EXPRESSION_COLUMN, PROMPT_COLUMN])
            for p in problems:
                writer.writerow([p.expression, p.prompt])
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary shared data files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path) -> str:
    """Hex sha256 of a file's bytes (used to pin which dataset a run trained on)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
