"""What a trainer checks before it touches the bucket: the task, its datasets and where its
signing key lives.

A start that fails on one of these leaves nothing behind: no object, and no new folder
bucket (`vrl trainer` makes a folder bucket only after this passed, cli/train.py). It imports
no torch, so the command runs it before the seconds of heavy imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from volunteer_rl.config import TrainerConfig
from volunteer_rl.errors import VrlError
from volunteer_rl.protocol.manifest import read_manifest
from volunteer_rl.protocol.signing import Trust, key_path, parse_private_key, public_key_text
from volunteer_rl.storage.uri import local_folder
from volunteer_rl.storage.base import Storage
from volunteer_rl.task.base import Row, Task
from volunteer_rl.task.dataset import load_rows
from volunteer_rl.task.registry import TaskInfo
from volunteer_rl.task.registry import load as load_task


class TrainerError(VrlError):
    """A condition the trainer cannot run under (named object, one line)."""


def dataset_paths(cfg: TrainerConfig, task: Task | None = None) -> tuple[Path, Path]:
    """--dataset and --eval-dataset, each defaulting to the task's own file (`task`: the one
    --task names, loaded here if not given)."""
    task = task or load_task(cfg.task)[0]
    own = task.data() or (None, None)
    train, held_out = cfg.dataset or own[0], cfg.eval_dataset or own[1]
    if not (train and held_out):
        raise TrainerError(f"task {task.name!r} ships no data: give --dataset and --eval-dataset")
    return Path(train), Path(held_out)


def signing_key_path(cfg: TrainerConfig) -> Path:
    """The trainer's private key file (--signing-key, else <work_dir>/signing-key.pem);
    TrainerError if it lies inside a folder bucket: whoever can read the bucket could then
    sign manifests."""
    path = key_path(cfg.signing_key, cfg.work_dir)
    folder = local_folder(cfg.bucket)
    if folder is not None and path.is_relative_to(folder.expanduser().resolve()):
        raise TrainerError(f"--signing-key {path}: inside the bucket folder {cfg.bucket}; keep "
                           "the private key out of the bucket")
    return path


LEGACY_KEY = Path(".vrl/trainer/signing-key.pem")
"""Where builds before the per-user default kept the key: under the folder a trainer ran in."""
POINT_AT_KEY = ("; start the trainer with --signing-key FILE (the key that signed this run) or "
                "--work-dir DIR (the folder holding its signing-key.pem)")


def refuse_new_key(storage: Storage, path: Path, allow_unsigned: bool) -> None:
    """Before a new key is made at `path`: TrainerError if the bucket's manifest.json is
    signed, since its run belongs to that key and a new one could never resume it. The one
    line names the key that signed it, where this trainer looked, and how to point at the
    right key. An unsigned manifest (an older trainer) passes with --allow-unsigned, and
    refuses as any reader does without it."""
    found = Trust(None, allow_unsigned, origin=f"{path.name}")
    if read_manifest(storage, trust=found) is None or found.key is None:
        return
    legacy = ""
    try:
        if public_key_text(parse_private_key(LEGACY_KEY.read_bytes(), str(LEGACY_KEY))) == found.key:
            legacy = (f"; {LEGACY_KEY.resolve()} (an older build's default) holds it: "
                      f"--work-dir {LEGACY_KEY.parent}")
    except (OSError, VrlError):
        pass  # no old key file here, or one that is no lead
    raise TrainerError(f"manifest.json of {storage.uri} is signed by {found.key}, and there is no "
                       f"signing key at {path}; a new key could not resume this run, so none "
                       f"was made{legacy}" + POINT_AT_KEY)


@dataclass
class Inputs:
    """Everything a trainer reads before it starts, read and checked."""

    task: Task
    task_info: TaskInfo
    train_path: Path
    eval_path: Path
    problems: list[Row]
    held_out: list[Row]
    key_path: Path


def read_inputs(cfg: TrainerConfig) -> Inputs:
    """The task --task names (TaskError if it is not installed), its train and held-out rows
    (DatasetError naming the file and row: missing, a missing column, a row the task refuses)
    and the signing key's path: one line for the first thing wrong, nothing written."""
    task, info = load_task(cfg.task)
    train_path, eval_path = dataset_paths(cfg, task)
    problems = load_rows(train_path, task)
    held_out = load_rows(eval_path, task)
    return Inputs(task, info, train_path, eval_path, problems, held_out, signing_key_path(cfg))
