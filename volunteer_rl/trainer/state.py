"""The trainer's own state between publishes, on the trainer's disk: optimizer moments, step
count, RNG, per-volunteer counts. The weights are the published checkpoint itself.

Saved for version N before the manifest commits N, as a folder whose `state.json` is
written last (tmp + rename): a folder without it was cut short and is ignored. On restart
the trainer loads the state of the version the manifest names, so optimizer and weights
always belong together. Plain safetensors + JSON: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from volunteer_rl.faults import crash_point
from volunteer_rl.protocol import layout

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
MASTER_FILE = "master.safetensors"
"""fp32 master weights, saved only when the published checkpoint is not fp32 (bf16): the
checkpoint alone would lose their low bits on resume."""


def state_dir(root: Path, version: int) -> Path:
    return Path(root) / layout.version_dir(version)


def _local(value: torch.Tensor) -> torch.Tensor:
    """A tensor's own part: an FSDP2 rank's shard of a DTensor (trainer.ranks), else itself."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _like_param(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A saved moment back into the form of its parameter: this rank's shard made a DTensor
    again for an FSDP2 parameter (AdamW's scalar `step` stays a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or value.dim() == 0:
        return value
    return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride())


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Flatten an optimizer state_dict into named tensors + JSON-able rest (of a sharded
    optimizer: this rank's shards)."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, slots in sd["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = _local(value).detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def save_state(root: Path, version: int, opt: torch.optim.Optimizer, meta: dict,
               master: torch.nn.Module | None = None) -> Path:
    """Write state/v<version>/: optimizer tensors (and `master`'s fp32 weights if given), then
    state.json as the completion mark."""
    from safetensors.torch import save_file

    folder = state_dir(root, version)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tensors, rest = _optimizer_tensors(opt)
    rng = torch.get_rng_state()
    tensors["__rng__"] = rng
    save_file(tensors, str(folder / OPTIMIZER_FILE))
    if master is not None:
        from volunteer_rl.model.weights import write_weights

        with open(folder / MASTER_FILE, "wb") as f:
            write_weights(master, f, torch.float32)
    crash_point("state_save")
    tmp = folder / f"{STATE_FILE}.tmp"
    tmp.write_text(json.dumps({"version": version, "optimizer": rest, **meta}))
    os.replace(tmp, folder / STATE_FILE)
    return folder


def load_state(root: Path, version: int, opt: torch.optim.Optimizer) -> dict | None:
    """Restore the optimizer and RNG saved for `version`; its meta dict, or None if there is
    no complete state for that version."""
    from safetensors.torch import load_file

    folder = state_dir(root, version)
    if not (folder / STATE_FILE).exists():
        return None
    meta = json.loads((folder / STATE_FILE).read_text())
    tensors = load_file(str(folder / OPTIMIZER_FILE))
    torch.set_rng_state(tensors.pop("__rng__"))
    rest = meta.pop("optimizer")
    params = [p for group in opt.param_groups for p in group["params"]]
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        idx, slot = name.split(".", 1)
        state.setdefault(int(idx), {})[slot] = _like_param(value, params[int(idx)])
    for name, value in rest["scalars"].items():
        idx, slot = name.split(".", 1)
        state.setdefault(int(idx), {})[slot] = value
    opt.load_state_dict({"state": state, "param_groups": rest["param_groups"]})
    return meta


def master_weights(root: Path, version: int) -> Path | None:
    """The fp32 master weights saved with `version`'s complete state, if any."""
    folder = state_dir(root, version)
    path = folder / MASTER_FILE
    return path if (folder / STATE_FILE).exists() and path.exists() else None


def prune_states(root: Path, keep: set[int]) -> None:
    """Delete saved states of versions not in `keep`."""
    root = Path(root)
    if not root.exists():
        return
    for folder in root.iterdir():
        v = layout.parse_version_dir(folder.name)
        if v is not None and v not in keep:
            shutil.rmtree(folder, ignore_errors=True)
