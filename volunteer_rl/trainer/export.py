"""`vrl export`: a published version as a Hugging Face folder that tools outside vrl load.

Whole (the default): the version's weights as volunteers run them (a LoRA version: its base
with the adapter merged, model.lora) in fp32, written by save_policy, so
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads it. `--adapter` (LoRA
versions only): DIR holds PEFT's adapter folder (adapter_model.safetensors, the bucket's
adapter file as published, and adapter_config.json) and DIR/base the base model, so
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR/base), DIR)` loads
the same policy unmerged. Everything is checked as a volunteer checks it before it is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from volunteer_rl.errors import VrlError
from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.model.lora import adapter_config, adapter_file, fetch_adapter, spec_of
from volunteer_rl.model.policy import load_policy
from volunteer_rl.model.weights import save_policy
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import Manifest
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage.base import Storage
from volunteer_rl.trainer.evaluate import load_version, read_version

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
BASE_FOLDER = "base"


class ExportError(VrlError):
    """What `vrl export` cannot do (one line, naming the version or the folder)."""


def export_version(storage: Storage, version: int | None, dest: Path, work_dir: Path, *,
                   trust: Trust, adapter: bool = False) -> Manifest:
    """Write version `version` (the current one if None) into `dest`, an empty or new folder:
    whole and merged, or with `adapter` as PEFT's adapter folder over DIR/base (see the
    module's doc). Returns its manifest."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise ExportError(f"{dest}: not empty; export into a new or empty folder")
    if not adapter:
        m, policy = load_version(storage, version, work_dir, trust=trust)
        save_policy(policy, dest, torch.float32)
        return m
    m = read_version(storage, version, trust=trust)
    if m.adapter is None:
        raise ExportError(f"{layout.manifest_history_key(m.version)}: v{m.version} is published "
                          "whole, with no adapter; export it without --adapter")
    base = fetch_checkpoint(storage, m, dest / BASE_FOLDER, require_model=True)
    checked = fetch_adapter(storage, m, load_policy(base).model)
    dtype = getattr(torch, m.weights_dtype)
    (dest / PEFT_WEIGHTS).write_bytes(adapter_file(checked.tensors(), dtype))
    (dest / PEFT_CONFIG).write_text(json.dumps(adapter_config(spec_of(m), BASE_FOLDER), indent=1))
    return m
