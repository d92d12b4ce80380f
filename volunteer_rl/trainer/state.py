"""The trainer's own state between publishes, on the trainer's disk: optimizer moments, step
count, RNG, per-volunteer counts. The weights are the published checkpoint itself.

Saved for version N before the manifest commits N, as a folder whose `state.json` is
written last (tmp + rename): a folder without it was cut short and is ignored. On restart
the trainer loads the state of the version the manifest names, so optimizer and weights
always belong together. Plain safetensors + JSON: nothing is unpickled.

A trainer of several ranks (trainer.ranks) saves AdamW's moments sharded, with
torch.distributed.checkpoint: every rank writes its own shards into the version's
`optimizer/` folder (DCP's Hugging Face storage: one safetensors file per rank, each tensor's
offsets in its header, no pickled metadata file), and loading reshards them onto however many
ranks resume, one process included (save_sharded_optimizer, load_sharded_optimizer). The
rest (step, counts, RNG, fp32 masters) is the writer's, in the same folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from volunteer_rl.faults import crash_point
from volunteer_rl.model.weights import local_tensor
from volunteer_rl.protocol import layout

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
SHARDED_DIR = "optimizer"
"""The sharded optimizer state of a trainer of several ranks (torch.distributed.checkpoint)."""
MASTER_FILE = "master.safetensors"
"""fp32 master weights, saved only when the published checkpoint is not fp32 (bf16): the
checkpoint alone would lose their low bits on resume."""


ADAPTER_MASTER_FILE = "adapter.safetensors"
"""A LoRA trainer's adapters in fp32 (model.lora's file form), saved at every version: the
bucket's copy is in the published dtype, and the base is the bucket's."""


def state_dir(root: Path, version: int) -> Path:
    return Path(root) / layout.version_dir(version)


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Flatten an optimizer state_dict into named tensors + JSON-able rest."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, slots in sd["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def save_state(root: Path, version: int, opt: torch.optim.Optimizer, meta: dict,
               master: torch.nn.Module | None = None, sharded: bool = False,
               adapter: dict[str, torch.Tensor] | None = None) -> Path:
    """Write state/v<version>/: optimizer tensors (and `master`'s fp32 weights, or a LoRA
    trainer's fp32 `adapter` tensors, if given), then state.json as the completion mark. `sharded`: the ranks saved the optimizer's tensors
    already (save_sharded_optimizer, into this folder); only the rest is written here."""
    from safetensors.torch import save_file

    folder = state_dir(root, version)
    rng = torch.get_rng_state()
    if sharded:
        rest = {"sharded": True}
        save_file({"__rng__": rng}, str(folder / OPTIMIZER_FILE))
    else:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        tensors, rest = _optimizer_tensors(opt)
        tensors["__rng__"] = rng
        save_file(tensors, str(folder / OPTIMIZER_FILE))
    if master is not None:
        from volunteer_rl.model.weights import write_weights

        with open(folder / MASTER_FILE, "wb") as f:
            write_weights(master, f, torch.float32)
    if adapter is not None:
        save_file({n: t.float().contiguous() for n, t in adapter.items()},
                  str(folder / ADAPTER_MASTER_FILE))
    crash_point("state_save")
    tmp = folder / f"{STATE_FILE}.tmp"
    tmp.write_text(json.dumps({"version": version, "optimizer": rest, **meta}))
    os.replace(tmp, folder / STATE_FILE)
    return folder


def load_state(root: Path, version: int, opt: torch.optim.Optimizer | None,
               model: torch.nn.Module | None = None) -> dict | None:
    """Restore the optimizer and RNG saved for `version`; its meta dict, or None if there is
    no complete state for that version. The meta's "optimizer" says how the moments were
    saved: {"sharded": true} by ranks (loaded here only when a single process resumes them,
    which needs its `model`; ranks load them together, load_sharded_optimizer), else the
    optimizer's own. `opt` None: the meta and RNG only."""
    from safetensors.torch import load_file

    folder = state_dir(root, version)
    if not (folder / STATE_FILE).exists():
        return None
    meta = json.loads((folder / STATE_FILE).read_text())
    tensors = load_file(str(folder / OPTIMIZER_FILE))
    torch.set_rng_state(tensors.pop("__rng__"))
    rest = meta["optimizer"]
    if opt is None:
        return meta
    if rest.get("sharded"):
        load_sharded_optimizer(root, version, model, opt)
        return meta
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        idx, slot = name.split(".", 1)
        state.setdefault(int(idx), {})[slot] = value
    for name, value in rest["scalars"].items():
        idx, slot = name.split(".", 1)
        state.setdefault(int(idx), {})[slot] = value
    opt.load_state_dict({"state": state, "param_groups": rest["param_groups"]})
    return meta


def save_sharded_optimizer(root: Path, version: int, model: torch.nn.Module,
                           opt: torch.optim.Optimizer) -> None:
    """Every rank, together: this rank's shards of AdamW's moments into state/v<version>/
    optimizer/ (torch.distributed.checkpoint with its Hugging Face safetensors storage: each
    rank one file, offsets in its header). The writer then finishes the folder with
    save_state(sharded=True); until its state.json exists the folder does not count."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt)
    dcp.save({"state": osd["state"]},
             storage_writer=HuggingFaceStorageWriter(str(state_dir(root, version) / SHARDED_DIR),
                                                     file_indices(osd["state"]),
                                                     save_distributed=True))


def file_indices(state: dict[str, dict]) -> dict[str, int]:
    """DCP's file index (1..N) for each moment of each parameter (its flattened name,
    state.<parameter>.<moment>), filling each file up to FILE_BYTES of this rank's shards in
    order (a moment larger than that has a file of its own).

    The Hugging Face storage writer serializes each file in memory before it writes it
    (safetensors.torch.save: every tensor's bytes, then the file's: two copies of it). With
    one file per rank that was twice the rank's whole share of the moments at once, 4.4 GiB
    for a Qwen3-0.6B shape over 2 ranks, the largest part of a rank's peak; now it is at most
    twice FILE_BYTES or the largest moment's shard (the embedding's). A small model still
    writes one file per rank (a file is also an fsync)."""
    index, used, out = 1, 0, {}
    for name, moments in state.items():
        for key, value in moments.items():
            local = local_tensor(value) if torch.is_tensor(value) else None
            size = local.numel() * local.element_size() if local is not None else 0
            if used and used + size > FILE_BYTES:
                index, used = index + 1, 0
            out[f"state.{name}.{key}"] = index
            used += size
    return out


FILE_BYTES = 256 << 20
"""Bytes of moments (this rank's shards) per optimizer state file (file_indices)."""


def load_sharded_optimizer(root: Path, version: int, model: torch.nn.Module,
                           opt: torch.optim.Optimizer) -> None:
    """Every rank together (or one process alone): the moments save_sharded_optimizer wrote,
    resharded onto this model's parameters, whatever number of ranks saved them. The
    template is the optimizer's own state, which get_optimizer_state_dict initialises."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    osd = get_optimizer_state_dict(model, opt)
    template = {"state": osd["state"]}
    with warnings.catch_warnings():  # one process: DCP says it assumes so, which it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=HuggingFaceStorageReader(
            str(state_dir(root, version) / SHARDED_DIR)))
    set_optimizer_state_dict(model, opt, {"state": template["state"],
                                          "param_groups": osd["param_groups"]})


def named_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """A plain (unsharded) optimizer's state keyed by parameter name instead of index, the form
    torch.distributed.checkpoint's set_optimizer_state_dict takes whole (ranks.
    load_full_optimizer_state). The optimizer was built on model.parameters(), so its indices
    follow named_parameters()."""
    names = [n for n, _ in model.named_parameters()]
    sd = opt.state_dict()
    return {"state": {names[i]: dict(slots) for i, slots in sd["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [names[i] for i in g["params"]]}
                             for g in sd["param_groups"]]}


def has_sharded_optimizer(root: Path, version: int) -> bool:
    """True if `version`'s complete state holds sharded moments (saved by ranks)."""
    path = state_dir(root, version) / STATE_FILE
    if not path.exists():
        return False
    return bool(json.loads(path.read_text())["optimizer"].get("sharded"))


def prepare_sharded(root: Path, version: int) -> None:
    """The writer, before the ranks save `version`'s moments: an empty folder for them."""
    folder = state_dir(root, version)
    shutil.rmtree(folder, ignore_errors=True)
    (folder / SHARDED_DIR).mkdir(parents=True)


def master_weights(root: Path, version: int) -> Path | None:
    """The fp32 master weights saved with `version`'s complete state, if any."""
    folder = state_dir(root, version)
    path = folder / MASTER_FILE
    return path if (folder / STATE_FILE).exists() and path.exists() else None


def adapter_master(root: Path, version: int) -> dict[str, torch.Tensor] | None:
    """The fp32 adapters saved with `version`'s complete state, if any."""
    from safetensors.torch import load_file

    folder = state_dir(root, version)
    path = folder / ADAPTER_MASTER_FILE
    return load_file(str(path)) if (folder / STATE_FILE).exists() and path.exists() else None


def prune_states(root: Path, keep: set[int]) -> None:
    """Delete saved states of versions not in `keep`."""
    root = Path(root)
    if not root.exists():
        return
    for folder in root.iterdir():
        v = layout.parse_version_dir(folder.name)
        if v is not None and v not in keep:
            shutil.rmtree(folder, ignore_errors=True)
